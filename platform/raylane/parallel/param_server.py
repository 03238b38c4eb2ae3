"""A parameter server on Ray actors: shards of the parameters, each with the configured
optimizer over them.

Workers push gradients and get the shard's current parameters back without waiting for each
other (Ray Core's parameter-server pattern; Ray carries the tensors). Each update's staleness
is the number of updates the shard applied since the pushing worker last read it; with
`staleness_lr` the learning rate of that update is divided by it. `StalenessClock` bounds how
far a worker may run ahead of the slowest (stale-synchronous parallel).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np
import ray
import torch

from raylane.models.optim import build_optimizer


class Shard:
    """Some of the model's parameters and the configured optimizer over them."""

    def __init__(
        self,
        params: list[np.ndarray],
        lr: float,
        weight_decay: float,
        staleness_lr: bool,
        optimizer: str = "adamw",
    ):
        torch.set_num_threads(1)
        self.params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
        self.optimizer = build_optimizer(self.params, optimizer, lr, weight_decay)
        self.lr = lr
        self.staleness_lr = staleness_lr
        self.version = 0
        self.staleness: Counter[int] = Counter()

    def push(self, grads: list[np.ndarray], read_version: int) -> tuple[list[np.ndarray], int]:
        """Apply one worker's gradients; return the parameters after the update."""
        staleness = self.version - read_version
        self.staleness[staleness] += 1
        scale = 1.0 / staleness if self.staleness_lr and staleness > 1 else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * scale
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = torch.from_numpy(np.array(grad))  # Ray's arrays are read-only
        self.optimizer.step()
        self.version += 1
        return self.read()

    def read(self) -> tuple[list[np.ndarray], int]:
        return [p.detach().numpy().copy() for p in self.params], self.version

    def staleness_counts(self) -> dict[int, int]:
        return dict(self.staleness)


class Clock:
    """Each worker's step count; `advance` returns once the caller is at most `bound` steps
    ahead of the slowest worker still running."""

    def __init__(self, workers: int, bound: int):
        self.clocks = [0] * workers
        self.done: set[int] = set()
        self.bound = bound
        self.changed = asyncio.Condition()

    def _slowest(self) -> int:
        running = [c for r, c in enumerate(self.clocks) if r not in self.done]
        return min(running) if running else max(self.clocks)

    async def advance(self, rank: int) -> float:
        """Count one step of `rank`'s; return the seconds it was held back."""
        started = time.perf_counter()
        async with self.changed:
            self.clocks[rank] += 1
            self.changed.notify_all()
            await self.changed.wait_for(lambda: self.clocks[rank] - self._slowest() <= self.bound)
        return time.perf_counter() - started

    async def pause(self, rank: int) -> None:
        """The worker stops stepping for now (its epoch's steps are done): nobody waits for
        it. It keeps its clock, so when it resumes, those ahead of it wait again."""
        async with self.changed:
            self.done.add(rank)
            self.changed.notify_all()

    async def resume(self, rank: int) -> None:
        async with self.changed:
            self.done.discard(rank)


# The actors; the plain classes above are what unit tests drive.
ParameterShard = ray.remote(num_cpus=0)(Shard)
StalenessClock = ray.remote(num_cpus=0)(Clock)


def assign_shards(sizes: list[int], shards: int) -> list[list[int]]:
    """Parameter indices per shard, largest first onto the least-loaded shard."""
    load = [0] * shards
    owned: list[list[int]] = [[] for _ in range(shards)]
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        target = load.index(min(load))
        owned[target].append(index)
        load[target] += sizes[index]
    return [sorted(indices) for indices in owned if indices]
