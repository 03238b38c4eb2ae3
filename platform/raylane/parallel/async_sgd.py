"""Asynchronous ('async') and bounded-staleness ('ssp') training on a parameter server.

Each worker computes gradients on its own batches, pushes them to the parameter shards
(`raylane.parallel.param_server`) and continues from the parameters they send back, without
waiting for the other workers ('async'); under 'ssp' it also waits whenever it is more than
`parallelism.staleness` steps ahead of the slowest. The shards apply the configured optimizer
(`training.optimizer`); the workers' own optimizers are unused. At the end of each epoch every
worker reads the shards, so evaluation and checkpoints see one model. The server's optimizer
state is not in the checkpoint: a resumed run restarts its moments.
"""

from __future__ import annotations

import uuid
from collections import Counter

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch import nn

from raylane.config import RaylaneConfig
from raylane.parallel.base import WholeModelReplica, world_size
from raylane.parallel.param_server import ParameterShard, StalenessClock, assign_shards

NAMESPACE = "raylane-param-server"


class ParameterServerTraining(WholeModelReplica):
    steps_optimizer = False  # the shards apply the optimizer

    def __init__(self, cfg: RaylaneConfig, rank: int):
        super().__init__(cfg, rank)
        par = cfg.parallelism
        self.bound = par.dims.sync.staleness  # None: asynchronous, unbounded
        self.shard_count = par.ps_shards
        self.lr, self.weight_decay = cfg.training.lr, cfg.training.weight_decay
        self.optimizer_kind = cfg.training.optimizer
        self.staleness_lr = par.staleness_lr
        self.shards: list = []
        self.clock = None
        self.blocked_s = 0.0
        self.run_tables: dict[str, dict] = {}

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.model = self.place(model)
        self.params = list(self.model.parameters())
        return self.model

    def _start_servers(self) -> None:
        """Rank 0 starts the shards from its parameters (after any checkpoint was restored)
        and waits until they answer; the others then find them by name. Collective."""
        names = [None]
        if self.rank == 0:
            run = uuid.uuid4().hex[:12]
            sizes = [p.numel() for p in self.params]
            owned = assign_shards(sizes, self.shard_count)
            actors = [
                ParameterShard.options(
                    name=f"raylane-ps-{run}-{index}", namespace=NAMESPACE
                ).remote(
                    [self.params[i].detach().cpu().numpy() for i in indices],
                    self.lr,
                    self.weight_decay,
                    self.staleness_lr,
                    self.optimizer_kind,
                )
                for index, indices in enumerate(owned)
            ]
            if self.bound is not None:
                actors.append(
                    StalenessClock.options(name=f"raylane-ssp-{run}", namespace=NAMESPACE).remote(
                        world_size(), self.bound
                    )
                )
            ray.get([actor.__ray_ready__.remote() for actor in actors])
            self._actors = actors  # the actors live as long as their creator holds them
            names = [(run, owned)]
        if world_size() > 1:
            dist.broadcast_object_list(names, src=0)
        run, self.owned = names[0]
        self.shards = [
            ray.get_actor(f"raylane-ps-{run}-{i}", namespace=NAMESPACE)
            for i in range(len(self.owned))
        ]
        if self.bound is not None:
            self.clock = ray.get_actor(f"raylane-ssp-{run}", namespace=NAMESPACE)
        self.versions = [0] * len(self.shards)

    def _load(self, shard: int, values: list[np.ndarray], version: int) -> None:
        with torch.no_grad():
            for index, value in zip(self.owned[shard], values, strict=True):
                self.params[index].copy_(torch.as_tensor(value, device=self.device))
        self.versions[shard] = version

    def sync_gradients(self, model: nn.Module) -> None:
        """Push this worker's gradients to their shards and continue from the parameters they
        send back (the shards step the optimizer); under 'ssp', wait while too far ahead. The
        first call starts the shards (counted as that step's communication)."""
        if not self.shards:
            self._start_servers()
        grads = [p.grad.detach().cpu().numpy() for p in self.params]
        pushes = []
        for shard, owned in enumerate(self.owned):
            mine = [grads[i] for i in owned]
            self.sent_bytes += sum(g.nbytes for g in mine)
            pushes.append(self.shards[shard].push.remote(mine, self.versions[shard]))
        # Under 'ssp' the clock is told in the same round trip as the pushes: the worker
        # still cannot start its next step until it is within the bound.
        advance = [self.clock.advance.remote(self.rank)] if self.clock is not None else []
        replies = ray.get(pushes + advance)
        self.blocked_s += replies.pop() if advance else 0.0
        for shard, (values, version) in enumerate(replies):
            self._load(shard, values, version)
        self.dense_bytes += sum(g.nbytes for g in grads)

    def steps_done(self) -> None:
        """This worker's steps of the epoch are over: under 'ssp', nobody waits for it until
        every worker is back in step (`epoch_stats`)."""
        if self.clock is not None:
            ray.get(self.clock.pause.remote(self.rank))

    def epoch_stats(self) -> dict[str, float]:
        """Every worker reads the final parameters (collective); rank 0 the staleness of
        every update so far. Bytes: gradients pushed (parameters come back the same size)."""
        if self.clock is not None:
            ray.get(self.clock.resume.remote(self.rank))
        if world_size() > 1:
            # Every push of the epoch applied, and every worker's clock counts again before
            # any starts the next epoch.
            dist.barrier()
        if not self.shards:
            return {}
        for shard, (values, version) in enumerate(ray.get([s.read.remote() for s in self.shards])):
            self._load(shard, values, version)
        stats: dict[str, float] = {
            "comm_bytes_per_step": self.sent_bytes / max(self.steps, 1),
            "comm_bytes_ratio": self.sent_bytes / max(self.dense_bytes, 1),
            "ssp_blocked_s": self.blocked_s,
        }
        if self.rank == 0:
            counts: Counter[int] = Counter()
            for shard_counts in ray.get([s.staleness_counts.remote() for s in self.shards]):
                counts.update(shard_counts)
            total = sum(counts.values())
            stats["staleness_mean"] = sum(k * v for k, v in counts.items()) / max(total, 1)
            stats["staleness_max"] = float(max(counts, default=0))
            # Updates per staleness so far in the run, logged as staleness_histogram.json.
            self.run_tables = {
                "staleness_histogram": {str(k): v for k, v in sorted(counts.items())}
            }
        self.sent_bytes = self.dense_bytes = self.steps = 0
        self.blocked_s = 0.0
        return stats
