"""Bounded staleness (and none: async) with more than one worker: the parameter server's shard
and clock (`raylane.parallel.param_server.Shard` and `Clock`, the classes its Ray actors run),
driven by 3 workers of unequal speed in one event loop, each step as `ParameterServerTraining.
sync_gradients` takes it: the gradient pushed to the shard and the clock advanced at once (two
actors, so either may be served first), the worker held until it is within `staleness` steps of
the slowest, then continuing from the parameters the push returned. (`sync_gradients` itself
calls Ray's actors and is not run here; the order of its calls is.)

What the workers do between pushes is scripted from a seeded generator (a number of event-loop
turns per step, one worker 8x slower): the run is deterministic, and exact checks hold:

- no worker starts a step more than `staleness` steps ahead of the slowest worker still running;
- the versions a worker continues from only increase, and the shard's staleness record (updates
  applied since the pushing worker's read) is exactly what the pushes' log gives;
- the parameters each gradient is computed on hold every other worker's updates up to
  `staleness + 2` steps behind the pusher's own step count: one step because each worker
  continues from what its push returned (not from after its wait), one because its push and
  its clock advance travel concurrently.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import numpy as np
import pytest

from raylane.parallel.param_server import Clock, Shard

WORKERS, STALENESS, STEPS = 3, 1, 12
SLOW = 2  # this worker's steps take 8x the turns of the others'
# Turns before a push reaches the shard: up to 10, so that a push may arrive well after the
# clock heard of its step (what lets the `staleness + 2` case happen).
PUSH_DELAY = 10


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


class Run:
    """One shard, one clock and the log of every push."""

    def __init__(self, bound: int | None) -> None:
        self.bound = bound
        self.shard = Shard([np.zeros(4, dtype=np.float32)], lr=0.1, weight_decay=0.0,
                           staleness_lr=False, optimizer="sgd")  # fmt: skip
        # 'async' (bound None) keeps no clock: this one only counts each worker's steps.
        self.clock = Clock(WORKERS, STEPS if bound is None else bound)
        self.applied: list[tuple[int, int]] = []  # (worker, step) in the order applied
        self.ahead: list[int] = []  # how far ahead of the slowest each step started
        self.pressed = 0  # advances that found their worker past the bound: it had to wait
        self.lags: list[int] = []  # per gradient and other worker: steps not yet seen
        self.staleness: Counter[int] = Counter()

    def running_slowest(self) -> int:
        running = [c for w, c in enumerate(self.clock.clocks) if w not in self.clock.done]
        return min(running)

    async def push(self, worker: int, step: int, read_version: int, delay: int):
        await _turns(delay)  # the push reaches the shard after the clock hears of the step
        self.staleness[self.shard.version - read_version] += 1
        self.applied.append((worker, step))
        grads = [np.full(4, worker + 1, dtype=np.float32)]
        return self.shard.push(grads, read_version)

    async def worker(self, worker: int, rng: random.Random) -> list[int]:
        _, version = self.shard.read()
        seen = 0  # updates in the parameters this worker holds (the shard applies in order)
        versions = []
        for step in range(1, STEPS + 1):
            self.ahead.append(self.clock.clocks[worker] - self.running_slowest())
            self._record_lags(worker, step, seen)
            await _turns(rng.randint(1, 4) * (8 if worker == SLOW else 1))  # the step
            if self.bound is not None:
                self.pressed += self.clock.clocks[worker] + 1 - self.running_slowest() > self.bound
            push = self.push(worker, step, version, delay=rng.randint(0, PUSH_DELAY))
            if self.bound is None:  # 'async': no clock, the push alone
                self.clock.clocks[worker] += 1  # the step count only (never waited on)
                pushed = await push
            else:
                pushed, _ = await asyncio.gather(push, self.clock.advance(worker))
            _, version = pushed
            seen = version
            versions.append(version)
        if self.bound is not None:
            await self.clock.pause(worker)  # its steps are done: nobody waits for it
        else:
            self.clock.done.add(worker)
        return versions

    def _record_lags(self, worker: int, step: int, seen: int) -> None:
        """For each other worker, how many of its steps before this one's are missing from
        the parameters this step's gradient is computed on."""
        for other in range(WORKERS):
            if other != worker:
                included = max((s for w, s in self.applied[:seen] if w == other), default=0)
                self.lags.append(max(step - 1 - included, 0))


def _scripted(bound: int | None) -> tuple[Run, list[list[int]]]:
    """The scripted run (deterministic) under a clock of `bound`; each worker's versions."""

    async def main():
        run = Run(bound)
        rngs = [random.Random(worker) for worker in range(WORKERS)]
        versions = await asyncio.wait_for(
            asyncio.gather(*(run.worker(w, rngs[w]) for w in range(WORKERS))), 30
        )  # a guard against a hang only
        return run, versions

    return asyncio.run(main())


@pytest.fixture(scope="module")
def ran() -> tuple[Run, list[list[int]]]:
    return _scripted(STALENESS)


def test_no_worker_runs_more_than_the_bound_ahead_of_the_slowest(ran):
    run, _ = ran
    print(f"ahead of the slowest at each step's start: {Counter(run.ahead)}, "
          f"advances past the bound {run.pressed}")  # fmt: skip
    assert len(run.ahead) == WORKERS * STEPS
    assert max(run.ahead) <= STALENESS
    # The bound was reached and enforced: workers started steps exactly at it, and advances
    # found their worker past it (so they waited).
    assert max(run.ahead) == STALENESS and run.pressed > 0
    assert run.clock.clocks == [STEPS] * WORKERS


def test_versions_increase_and_the_shard_records_each_pushes_staleness(ran):
    run, versions = ran
    for mine in versions:
        assert all(b > a for a, b in zip(mine, mine[1:], strict=False)), mine
    assert run.shard.version == WORKERS * STEPS == len(run.applied)
    assert Counter(run.shard.staleness_counts()) == run.staleness
    # With 3 workers an update is usually several versions old; never older than the
    # other workers' steps the clock lets happen between a read and the next push.
    print(f"staleness in updates: {sorted(run.staleness.items())}")
    assert max(run.staleness) <= (WORKERS - 1) * (2 * STALENESS + 4)
    assert max(run.staleness) >= WORKERS - 1


def test_each_gradient_sees_every_update_up_to_the_bound_plus_two_steps_back(ran):
    run, _ = ran
    print(f"steps of another worker missing from a gradient's parameters: {Counter(run.lags)}")
    assert max(run.lags) <= STALENESS + 2
    # The same script without a bound leaves the slow worker's updates much further behind:
    # the clock is what keeps them within it.
    unbounded, _ = _scripted(STEPS)
    print(f"without a bound: {Counter(unbounded.lags)}")
    assert max(unbounded.ahead) > STALENESS + 2 and max(unbounded.lags) > STALENESS + 2


def test_async_applies_every_push_once_in_order_with_the_staleness_it_had():
    """'async' (no clock) on the same script: no worker ever waits, every push is applied
    once, each worker's versions only increase, and the shard's staleness record is exactly
    the pushes' log; the slow worker falls far behind and its updates arrive stale."""
    run, versions = _scripted(None)
    for mine in versions:
        assert all(b > a for a, b in zip(mine, mine[1:], strict=False)), mine
    assert run.shard.version == WORKERS * STEPS == len(run.applied)
    assert sorted(run.applied) == [(w, s) for w in range(WORKERS) for s in range(1, STEPS + 1)]
    assert Counter(run.shard.staleness_counts()) == run.staleness
    print(f"async: ahead {Counter(run.ahead)}, staleness {sorted(run.staleness.items())}")
    # The fast workers finish while the slow one is a few steps in: far more than any bound.
    assert max(run.ahead) >= STEPS // 2 and max(run.lags) > STALENESS + 2
