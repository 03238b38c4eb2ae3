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

    def add(self, step_s: float, data_wait_s: float, parts: dict[str, float]) -> None:
        self.steps += 1
        self.step_s += step_s
        self.parts_s["data_wait"] += data_wait_s
        for name, seconds in parts.items():
            self.parts_s[name] += seconds

    def as_list(self) -> list[float]:
        return [self.step_s, *(self.parts_s[p] for p in PARTS), float(self.steps)]


def step_metrics(totals: list[float]) -> dict[str, float]:
    """Mean per-step milliseconds of every part over all workers' steps (`totals`: the sum of
    every worker's `StepTimes.as_list()`), and the split's relative error."""
    step_s, *parts_s, steps = totals
    if steps == 0:
        return {}
    metrics = {"step_ms": 1000 * step_s / steps}
    for name, seconds in zip(PARTS, parts_s, strict=True):
        metrics[f"step_{name}_ms"] = 1000 * seconds / steps
    metrics["step_split_error"] = abs(sum(parts_s) - step_s) / step_s if step_s > 0 else 0.0
    return metrics
