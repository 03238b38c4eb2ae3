"""Profile once: what a model's blocks cost to compute and what the cluster's links cost,
measured by a short Ray Train job on the cluster itself.

Every worker times one transformer block's forward and backward at a few micro-batch sizes
(achieved FLOP/s, by Megatron's FLOPs of a block) and the worker group's collectives at several
sizes: an all-reduce over all workers and a point-to-point exchange between ranks 0 and 1, each
fitted as alpha + beta * bytes. The figures feed the same cost model as catalog figures do,
as a cluster whose basis is 'measured'.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

MICRO_ROWS = (1, 2, 4, 8)
SIZES = tuple(4**k * 1024 for k in range(1, 7))  # 4 KiB .. 4 MiB
REPEATS = 5


@dataclass(frozen=True)
class LinkFit:
    """Seconds to move `nbytes` = alpha + beta * nbytes (ring steps included for collectives)."""

    alpha_s: float
    beta_s_per_byte: float

    @property
    def gbps(self) -> float:
        return 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else float("inf")


@dataclass(frozen=True)
class Profile:
    workers: int
    block_s: dict[str, float]  # rows per micro-batch -> forward + backward of one block
    block_flops_per_s: float  # achieved, at the largest micro-batch
    all_reduce: LinkFit | None  # None with one worker
    p2p: LinkFit | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def block_train_flops(rows: int, seq: int, width: int) -> float:
    """Forward and backward FLOPs of one transformer block (Megatron's formula)."""
    return 3 * 24 * rows * seq * width * width * (1 + seq / (6 * width))


def fit_line(sizes: list[float], seconds: list[float]) -> LinkFit:
    """Least-squares alpha + beta * size, both clamped at zero."""
    import numpy as np

    beta, alpha = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return LinkFit(alpha_s=max(float(alpha), 0.0), beta_s_per_byte=max(float(beta), 0.0))


def _median_s(step: Callable[[], None], repeats: int = REPEATS) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _time_block(cfg) -> dict[int, float]:
    import torch

    from raylane.models.gpt import Block

    model = cfg.model
    block = Block(model.d_model, model.n_heads)
    found = {}
    for rows in MICRO_ROWS:
        inputs = torch.randn(rows, model.input_dim, model.d_model, requires_grad=True)

        def step(inputs=inputs):
            block(inputs).sum().backward()

        found[rows] = _median_s(step)
    return found


def _time_collectives(rank: int, world: int) -> tuple[dict[int, float], dict[int, float]]:
    import torch
    import torch.distributed as dist

    all_reduce, p2p = {}, {}
    for size in SIZES:
        tensor = torch.zeros(size // 4)

        def reduce(tensor=tensor):
            dist.all_reduce(tensor)

        dist.barrier()
        all_reduce[size] = _median_s(reduce)

        def exchange(tensor=tensor):
            # One round trip between ranks 0 and 1; the others wait at the next barrier.
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            elif rank == 1:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)

        dist.barrier()
        p2p[size] = _median_s(exchange) / 2
    return all_reduce, p2p


def profile_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """What each Ray Train worker of the profile job runs; rank 0 returns the figures (the
    median over workers)."""
    import ray.train
    import torch
    import torch.distributed as dist

    from raylane.config import RaylaneConfig
    from raylane.train.loop import worker_threads

    cfg = RaylaneConfig.model_validate(loop_config["config"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(worker_threads(cfg, context.get_local_world_size()))
    torch.manual_seed(cfg.training.seed)
    mine = {"block": _time_block(cfg)}
    if world > 1:
        mine["all_reduce"], mine["p2p"] = _time_collectives(rank, world)
        gathered: list[dict] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    return summarise(gathered, cfg.model.input_dim, cfg.model.d_model)


def summarise(records: list[dict], seq: int, width: int) -> dict[str, Any]:
    def median_of(key: str) -> dict[int, float]:
        return {size: statistics.median(r[key][size] for r in records) for size in records[0][key]}

    block = median_of("block")
    largest = max(block)
    profile = Profile(
        workers=len(records),
        block_s={str(rows): seconds for rows, seconds in block.items()},  # JSON keys
        block_flops_per_s=block_train_flops(largest, seq, width) / block[largest],
        all_reduce=_fit(median_of("all_reduce")) if "all_reduce" in records[0] else None,
        p2p=_fit(median_of("p2p")) if "p2p" in records[0] else None,
    )
    return profile.as_dict()


def _fit(by_size: dict[int, float]) -> LinkFit:
    sizes = sorted(by_size)
    return fit_line(sizes, [by_size[s] for s in sizes])
