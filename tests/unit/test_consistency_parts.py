"""The pieces of relaxed-consistency training that need no cluster: the staleness clock's
bound, the parameter server's staleness bookkeeping, shard assignment, the straggler, and the
step-time split's arithmetic."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from raylane.config.schema import StragglerConfig
from raylane.parallel.param_server import Clock, Shard, assign_shards
from raylane.tracking.step_times import StepTimes, step_metrics
from raylane.train.straggler import Straggler

# A guard against a hang only, never a measurement: the clock's waits end on other workers'
# steps, which these scenarios take in the same event loop.
HANG_S = 30.0


async def _settle() -> None:
    """Let every task the last step woke run until it blocks again (no wall-clock wait)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_worker_ahead_by_more_than_the_bound_waits_for_the_slowest():
    async def scenario():
        clock = Clock(workers=2, bound=2)
        await clock.advance(0)  # 1 ahead
        await clock.advance(0)  # 2 ahead: still allowed
        third = asyncio.create_task(clock.advance(0))  # 3 ahead: must wait
        await _settle()
        assert clock.clocks == [3, 0] and not third.done()  # counted, and held
        released = await clock.advance(1)  # the slow worker steps: 0 is 2 ahead again
        # The worker held back says how long it waited: longer than the step that freed it.
        held = await asyncio.wait_for(third, HANG_S)
        assert held > released >= 0
        # A worker that paused (end of its epoch) holds nobody back.
        await clock.pause(1)
        for _ in range(5):
            await asyncio.wait_for(clock.advance(0), HANG_S)
        assert clock.clocks == [8, 1]
        # Back from its pause, the slow worker keeps its clock: the one ahead waits again, and
        # is let go on exactly the step that brings the slow worker within the bound.
        await clock.resume(1)
        ahead = asyncio.create_task(clock.advance(0))
        held_after = []  # whether it is still held after each of the slow worker's steps
        for _ in range(6):
            await _settle()
            held_after.append(not ahead.done())
            await asyncio.wait_for(clock.advance(1), HANG_S)
        await _settle()
        assert held_after == [True] * 6 and ahead.done()  # let go on the sixth step exactly
        assert clock.clocks == [9, 7]  # 9 - 7 == bound
        await ahead

    asyncio.run(scenario())


def test_the_server_records_each_updates_staleness_and_can_scale_its_rate():
    params = [np.ones(3, dtype=np.float32)]
    grads = [np.ones(3, dtype=np.float32)]
    plain = Shard(params, lr=0.1, weight_decay=0.0, staleness_lr=False)
    _, version = plain.push(grads, read_version=0)  # fresh: staleness 0
    plain.push(grads, read_version=0)  # one update behind
    plain.push(grads, read_version=0)  # two behind
    assert version == 1 and plain.staleness_counts() == {0: 1, 1: 1, 2: 1}

    scaled = Shard(params, lr=0.1, weight_decay=0.0, staleness_lr=True)
    for _ in range(3):
        scaled.push(grads, read_version=0)
    # AdamW's first steps move by ~lr; the stale update of staleness 2 moves by lr / 2.
    moved_plain = 1 - plain.read()[0][0][0]
    moved_scaled = 1 - scaled.read()[0][0][0]
    assert moved_plain == pytest.approx(0.3, rel=0.05)
    assert moved_scaled == pytest.approx(0.25, rel=0.05)


def test_shards_balance_parameter_sizes():
    owned = assign_shards([1000, 10, 900, 20, 100], shards=2)
    sizes = [sum([1000, 10, 900, 20, 100][i] for i in shard) for shard in owned]
    assert sorted(i for shard in owned for i in shard) == [0, 1, 2, 3, 4]
    assert max(sizes) - min(sizes) <= 100


def test_stragglers_take_turns_and_a_transient_one_stops():
    cfg = StragglerConfig(rank=[0, 1], every=4, delay_s=0.001, last_epoch=0)
    first, second, other = Straggler(cfg, 0), Straggler(cfg, 1), Straggler(cfg, 2)
    slept = {0: [], 1: [], 2: []}
    for step in range(8):
        for rank, straggler in ((0, first), (1, second), (2, other)):
            straggler.maybe_wait(epoch=0, step=step)
            if straggler.waited_s > 0:
                slept[rank].append(step)
    assert slept == {0: [0, 4], 1: [2, 6], 2: []}
    first.maybe_wait(epoch=1, step=0)
    assert first.waited_s == 0.0  # past last_epoch


def test_step_split_reports_means_and_the_unaccounted_share():
    times = StepTimes()
    times.add(0.010, 0.001, {"compute": 0.007, "comm": 0.001})
    times.add(0.012, 0.002, {"compute": 0.007, "comm": 0.002})
    metrics = step_metrics(times.as_list())
    assert metrics["step_ms"] == pytest.approx(11.0)
    assert metrics["step_compute_ms"] == pytest.approx(7.0)
    assert metrics["step_data_wait_ms"] == pytest.approx(1.5)
    assert metrics["step_first_wait_ms"] == pytest.approx(0.5)  # the first step's 1 ms, per step
    assert metrics["step_split_error"] == pytest.approx(2 / 22)
