"""One console line per trial event while Ray Tune runs the search.

Tune's own status tables repeat every trial's whole config every 30 s; a person watching a
search wants to know which layout runs now, how fast it went, and how many are left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ray.tune import Callback

log = logging.getLogger("raylane")


class TrialProgress(Callback):
    """Tune callback (runs in the driver): start, per-epoch throughput, and end of each trial."""

    def __init__(self, total: int, epochs: int, emit: Callable[[str], None] = log.info):
        self._total = total
        self._epochs = epochs
        self._emit = emit
        self._started: dict[str, float] = {}
        self._order: dict[str, int] = {}
        self._search_start = time.monotonic()

    def _name(self, trial) -> str:
        number = self._order.setdefault(trial.trial_id, len(self._order) + 1)
        return f"trial {number}/{self._total} {trial.config.get('key', trial.trial_id)}"

    def on_trial_start(self, iteration, trials, trial, **info):
        self._started[trial.trial_id] = time.monotonic()
        self._emit(f"{self._name(trial)}: started")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        epoch = result.get("training_iteration", "?")
        parts = [f"{self._name(trial)}: epoch {epoch}/{self._epochs}"]
        if "train_loss" in result:
            parts.append(f"train_loss {result['train_loss']:.4f}")
        if "train_samples_per_s" in result:
            parts.append(f"{result['train_samples_per_s']:,.0f} samples/s")
        self._emit("  ".join(parts))

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finish(trial, "done")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finish(trial, "failed (reason in the table)")

    def _finish(self, trial, what: str) -> None:
        took = time.monotonic() - self._started.get(trial.trial_id, time.monotonic())
        left = self._total - len(self._started)  # trials run one at a time
        elapsed = time.monotonic() - self._search_start
        self._emit(
            f"{self._name(trial)}: {what} in {took:.0f} s  ({left} left, {elapsed:.0f} s elapsed)"
        )
