"""A straggler you can switch on: a worker sleeps before some of its steps.

On one machine every worker runs at the same speed, so the cost of waiting for the slowest
(synchronous all-reduce) against not waiting (asynchronous or bounded-staleness training) is
invisible. `parallelism.straggler` makes a worker slow every `every`-th step for `delay_s`,
during epochs `first_epoch`..`last_epoch` (a transient straggler when `last_epoch` is set).
Several ranks take turns: each straggles at its own offset within the `every` steps, so a
synchronous step waits for each of them while an unsynchronised worker pays only its own.
"""

from __future__ import annotations

import time

from raylane.config.schema import StragglerConfig


class Straggler:
    def __init__(self, cfg: StragglerConfig | None, rank: int):
        self.cfg = cfg if cfg is not None and rank in cfg.ranks else None
        if self.cfg is not None:
            turn = cfg.ranks.index(rank)
            self.offset = turn * cfg.every // len(cfg.ranks)
        self.waited_s = 0.0

    def maybe_wait(self, epoch: int, step: int) -> None:
        """Sleep if this worker straggles at this step; `waited_s` says how long it slept."""
        self.waited_s = 0.0
        cfg = self.cfg
        if cfg is None or epoch < cfg.first_epoch or (step - self.offset) % cfg.every != 0:
            return
        if cfg.last_epoch is not None and epoch > cfg.last_epoch:
            return
        started = time.perf_counter()
        time.sleep(cfg.delay_s)
        self.waited_s = time.perf_counter() - started
