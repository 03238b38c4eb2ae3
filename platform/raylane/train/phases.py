"""Where a training job's wall time goes, phase by phase.

The driver times its own phases (Ray start or connect, preflight, the run's set-up, the fit,
model logging and registration, shutdown); rank 0 marks, on the wall clock, when its loop
began, when it asked for its first batch, when the first batch and the first step were done and
when it made its last report. Together they split the fit into the worker group's start
(TrainController, worker processes, imports, process group), the worker's own set-up, the
dataset's first batch, the first step, training, and the fit's end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# In the order a job runs them; the console line and the MLflow metrics keep this order.
PHASES = (
    "ray",  # start a local Ray or connect to a cluster
    "preflight",  # tracking store, resume checkpoint, dataset check (prepared if built in)
    "run_setup",  # MLflow run, run context and cluster snapshot, datasets, trainer
    "worker_group",  # fit() called -> rank 0's loop starts: controller, workers, process group
    "worker_setup",  # model, parallel wrap, restore, placement, rank 0's MLflow logger
    "dataset",  # the first batch: Ray Data's pipeline start (near zero for the memory feed)
    "first_step",  # the first training step
    "training",  # every later step, evaluation and checkpoint, to the last report
    "fit_end",  # the last report -> fit() returns: the worker group's shutdown
    "model",  # the final model, its digest, torch.export logging, registration
    "shutdown",  # Ray shutdown (a local Ray only)
)

# Rank 0's marks (wall-clock seconds), sent back in its reports under these keys.
MARK_PREFIX = "_phase_mark_"
MARKS = ("loop_start", "data_start", "first_batch", "first_step", "last_report")


class PhaseClock:
    """Seconds per named phase, measured by `with clock.phase(name):` or added from marks."""

    def __init__(self) -> None:
        self.started = time.time()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}")
        begin = time.time()
        try:
            yield
        finally:
            self.add(name, time.time() - begin)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def split_fit(self, fit_start: float, fit_end: float, marks: dict[str, float]) -> None:
        """Split the fit's wall time [fit_start, fit_end] at rank 0's marks. A mark that is
        missing (a run resumed past its last epoch) folds its span into the next phase."""
        bounds = [fit_start]
        names = ("worker_group", "worker_setup", "dataset", "first_step", "training")
        for mark in MARKS:
            bounds.append(marks.get(mark, bounds[-1]))
        for name, begin, end in zip(names, bounds[:-1], bounds[1:], strict=True):
            self.add(name, end - begin)
        self.add("fit_end", fit_end - bounds[-1])

    def total(self) -> float:
        return time.time() - self.started

    def metrics(self) -> dict[str, float]:
        """`phase_<name>_s` for every measured phase, in job order."""
        return {f"phase_{name}_s": self.seconds[name] for name in PHASES if name in self.seconds}

    def line(self, total_s: float | None = None) -> str:
        """One line: each phase's seconds and the job's total."""
        parts = [f"{name} {self.seconds[name]:.1f}" for name in PHASES if name in self.seconds]
        total = self.total() if total_s is None else total_s
        return f"phases (s): {' · '.join(parts)} · total {total:.1f}"


class WorkerMarks:
    """Rank 0's wall-clock marks; the first time each is set wins."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {"loop_start": time.time()}

    def mark(self, name: str) -> None:
        if name not in MARKS:
            raise ValueError(f"unknown mark {name!r}")
        self.marks.setdefault(name, time.time())

    def report_metrics(self) -> dict[str, float]:
        """The marks so far, as extra entries of a report's metrics (with `last_report` now)."""
        now = {**self.marks, "last_report": time.time()}
        return {MARK_PREFIX + name: value for name, value in now.items()}


def marks_from_metrics(metrics: dict) -> dict[str, float]:
    return {
        key[len(MARK_PREFIX) :]: float(value)
        for key, value in metrics.items()
        if key.startswith(MARK_PREFIX)
    }
