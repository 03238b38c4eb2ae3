"""Where a training step's time goes: data wait, compute, exposed communication, bubble.

The loop measures each step's wall time (from asking for the batch to the end of the
optimizer step) and the data wait; the strategy measures the rest of the step in parts
(`ParallelStrategy.last_step_parts`): compute (forward, backward and optimizer step),
exposed communication (what the step waited for after its last gradient was ready), context
parallelism's ring (what attention waited for key/value blocks beyond its compute) and, for
pipelines, the bubble (a stage waiting for its neighbours), plus any delay a configured
straggler injected (`raylane.train.straggler`). The parts are measured, not
derived from the total, so `split_error` says how much of the step they leave unaccounted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARTS = ("data_wait", "compute", "comm", "ring", "bubble", "straggler")


@dataclass
class StepTimes:
    """Accumulated over one epoch on one worker."""

    steps: int = 0
    step_s: float = 0.0
    parts_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    #: The data wait of the epoch's first step: the input pipeline starting (with Ray Data, its
    #: read tasks and split coordinator), not the pipeline keeping up.
    first_wait_s: float = 0.0

    def add(self, step_s: float, data_wait_s: float, parts: dict[str, float]) -> None:
        if self.steps == 0:
            self.first_wait_s = data_wait_s
        self.steps += 1
        self.step_s += step_s
        self.parts_s["data_wait"] += data_wait_s
        for name, seconds in parts.items():
            self.parts_s[name] += seconds

    def as_list(self) -> list[float]:
        parts = (self.parts_s[p] for p in PARTS)
        return [self.step_s, *parts, float(self.steps), self.first_wait_s]


def step_metrics(totals: list[float]) -> dict[str, float]:
    """Mean per-step milliseconds of every part over all workers' steps (`totals`: the sum of
    every worker's `StepTimes.as_list()`), and the split's relative error.
    `step_first_wait_ms` is the share of `step_data_wait_ms` that waited for the epoch's first
    batch: `(step_data_wait_ms - step_first_wait_ms) / (step_ms - step_first_wait_ms)` is the
    fraction of the step time, that wait left out, spent waiting for data."""
    step_s, *parts_s, steps, first_wait_s = totals
    if steps == 0:
        return {}
    metrics = {"step_ms": 1000 * step_s / steps}
    for name, seconds in zip(PARTS, parts_s, strict=True):
        metrics[f"step_{name}_ms"] = 1000 * seconds / steps
    metrics["step_first_wait_ms"] = 1000 * first_wait_s / steps
    metrics["step_split_error"] = abs(sum(parts_s) - step_s) / step_s if step_s > 0 else 0.0
    return metrics
