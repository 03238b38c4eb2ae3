"""What a layout costs per epoch on on-demand or spot capacity, preemptions included.

Cost per epoch = devices x price per device-hour x expected hours per epoch. On-demand capacity
is not taken back: its hours are the predicted step time x the epoch's steps (W seconds of
work). Spot capacity is preempted at a rate lambda per hour for the whole job, the nodes times
the catalog's per-node rate (losing any node stops a synchronous group). Each preemption costs
the restart R (a replacement node, the group's restart, the checkpoint's reload) plus the work
since the last checkpoint; a checkpoint every tau seconds of training costs delta to write.

To first order the overhead per second of work is delta/tau + lambda (R + tau/2), least at
Young's interval tau* = sqrt(2 delta / lambda) (J. W. Young, "A first order approximation to
the optimum checkpoint interval", CACM 1974). The expected time used here is Daly's (J. T.
Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS
2006), exact for preemptions that arrive at random (exponentially), also during checkpoints
and restarts:

    T(tau) = M e^(R/M) (e^((tau + delta)/M) - 1) W / tau,    M = 1/lambda,

least where (1 - tau/M) e^(tau/M) = e^(-delta/M); that tau is found by Newton's method from
Young's, then rounded to whole steps (a checkpoint is taken between steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raylane.plan.hardware import Pricing
from raylane.plan.memory import FP32_ADAM

SECONDS_PER_HOUR = 3600.0
#: Restart after a preemption: a replacement node joining, the worker group restarting and the
#: checkpoint reloading. An assumption (`raylane plan --restart-s` changes it).
DEFAULT_RESTART_S = 300.0
#: Write bandwidth of the checkpoint to its storage (GB/s): an assumption, for a checkpoint
#: one writer sends to object storage (`raylane plan --checkpoint-s` replaces the estimate).
CHECKPOINT_WRITE_GBPS = 1.0


def checkpoint_seconds(params: float, gbps: float = CHECKPOINT_WRITE_GBPS) -> float:
    """Seconds to write a checkpoint of `params` parameters: fp32 weights and Adam's two
    moments in the distributed checkpoint (raylane keeps fp32 master weights in every
    precision), and the assembled fp32 weights beside it."""
    return params * (2 * FP32_ADAM.param + FP32_ADAM.optimizer) / (gbps * 1e9)


def young_interval_s(checkpoint_s: float, rate_per_hour: float) -> float:
    """Young's first-order optimum: sqrt(2 delta / lambda), in seconds of training."""
    return math.sqrt(2 * checkpoint_s * SECONDS_PER_HOUR / rate_per_hour)


def optimal_interval_s(checkpoint_s: float, rate_per_hour: float) -> float:
    """The interval that minimises Daly's expected time: the root x = tau/M of
    (1 - x) e^x = e^(-delta/M), by Newton's method from Young's interval."""
    mean_s = SECONDS_PER_HOUR / rate_per_hour
    target = math.exp(-checkpoint_s / mean_s)
    x = min(young_interval_s(checkpoint_s, rate_per_hour) / mean_s, 0.999)
    # The function is decreasing and concave on (0, 1), so Newton's steps reach the root
    # from the right after at most one step past it.
    for _ in range(100):
        step = ((1 - x) * math.exp(x) - target) / (-x * math.exp(x))
        x = min(max(x - step, 1e-12), 0.999999)
        if abs(step) < 1e-12:
            break
    return x * mean_s


def expected_seconds(
    work_s: float, interval_s: float, checkpoint_s: float, restart_s: float, rate_per_hour: float
) -> float:
    """Daly's expected wall time of `work_s` seconds of training with checkpoints every
    `interval_s`, preemptions at `rate_per_hour` (infinite when the work would never end)."""
    if rate_per_hour == 0:
        return work_s * (1 + checkpoint_s / interval_s)
    mean_s = SECONDS_PER_HOUR / rate_per_hour
    try:
        segment = (
            mean_s * math.exp(restart_s / mean_s) * math.expm1((interval_s + checkpoint_s) / mean_s)
        )
    except OverflowError:
        return math.inf
    return segment * work_s / interval_s


@dataclass(frozen=True)
class CostTerms:
    """What a layout's cost rests on besides its step time and the catalog's prices."""

    epoch_tokens: float  # tokens one epoch trains on
    checkpoint_s: float  # delta: writing one checkpoint
    restart_s: float = DEFAULT_RESTART_S  # R: back to training after a preemption


@dataclass(frozen=True)
class Capacity:
    """One way to rent the layout's devices for an epoch."""

    name: str  # 'on-demand' or 'spot'
    usd_per_hour: float  # all the layout's devices together
    hours: float  # expected wall-clock hours per epoch

    @property
    def usd(self) -> float:
        return self.usd_per_hour * self.hours


@dataclass(frozen=True)
class LayoutCost:
    """A layout's expected cost per epoch on each capacity, and how to checkpoint on spot."""

    nodes: int
    epoch_tokens: float
    on_demand: Capacity
    spot: Capacity
    rate_per_hour: float  # preemptions of the whole job on spot
    checkpoint_s: float
    restart_s: float
    young_s: float | None  # None: no preemptions expected, no checkpoints needed
    optimum_s: float | None
    checkpoint_steps: int | None  # the optimum in whole steps, as the spot hours assume

    @property
    def best(self) -> Capacity:
        return min(self.on_demand, self.spot, key=lambda capacity: capacity.usd)

    @property
    def other(self) -> Capacity:
        return self.on_demand if self.best is self.spot else self.spot

    @property
    def saving(self) -> float:
        """Share of the other capacity's cost that the best one saves."""
        return 1 - self.best.usd / self.other.usd if math.isfinite(self.other.usd) else 1.0

    def usd_per_million_tokens(self, capacity: Capacity) -> float:
        return capacity.usd / self.epoch_tokens * 1e6


def price_layout(
    step_s: float, tokens_per_step: float, devices: int, nodes: int, pricing: Pricing,
    terms: CostTerms,
) -> LayoutCost:  # fmt: skip
    """Expected cost per epoch of steps of `step_s` on `devices` devices over `nodes` nodes,
    on demand and on spot (checkpointing at the best whole-step interval)."""
    work_s = step_s * terms.epoch_tokens / tokens_per_step
    rate = nodes * pricing.spot_interruptions_per_node_hour
    checkpoint_s, young, optimum, steps = terms.checkpoint_s, None, None, None
    spot_s = work_s
    if rate > 0:
        young = young_interval_s(checkpoint_s, rate)
        optimum = optimal_interval_s(checkpoint_s, rate)
        steps = max(1, round(optimum / step_s))
        spot_s = expected_seconds(work_s, steps * step_s, checkpoint_s, terms.restart_s, rate)
    return LayoutCost(
        nodes=nodes,
        epoch_tokens=terms.epoch_tokens,
        on_demand=Capacity(
            "on-demand", devices * pricing.on_demand_usd_per_hour, work_s / SECONDS_PER_HOUR
        ),
        spot=Capacity("spot", devices * pricing.spot_usd_per_hour, spot_s / SECONDS_PER_HOUR),
        rate_per_hour=rate,
        checkpoint_s=checkpoint_s,
        restart_s=terms.restart_s,
        young_s=young,
        optimum_s=optimum,
        checkpoint_steps=steps,
    )
