"""Local SGD: every worker steps on its own gradients; parameters are averaged every H steps.

Between averages the replicas drift apart (that is the relaxed consistency); every
`local_sgd_period` steps torch's `PeriodicModelAverager` all-reduces the parameters, so the
bytes on the wire per step are the model's size / H instead of DDP's every step.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging import utils as averaging
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from raylane.config import RaylaneConfig
from raylane.parallel.base import WholeModelReplica, world_size


def _distributed() -> bool:
    return world_size() > 1


class LocalSGD(WholeModelReplica):
    replicas_agree = False  # parameters averaged at an epoch's end, each worker's moments not

    def __init__(self, cfg: RaylaneConfig, rank: int):
        super().__init__(cfg, rank)
        self.period = cfg.parallelism.local_sgd_period

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = self.place(model)
        if _distributed():  # one starting point for every replica
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        self.averager = PeriodicModelAverager(period=self.period, warmup_steps=0)
        self.model = model
        return model

    def after_step(self, model: nn.Module) -> None:
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if _distributed():
            averages = self.averager.step % self.period == 0
            self.averager.average_parameters(model.parameters())
            self.sent_bytes += model_bytes if averages else 0
        self.dense_bytes += model_bytes

    def epoch_stats(self) -> dict[str, float]:
        """Bytes sent per step against DDP's fp32 all-reduce of every gradient, every step.

        Replicas are averaged at the end of each epoch (collective), so evaluation and the
        checkpoint see one model."""
        if _distributed():
            averaging.average_parameters(self.model.parameters(), None)
            self.sent_bytes += sum(p.numel() * p.element_size() for p in self.model.parameters())
        stats = {}
        if self.dense_bytes and _distributed():
            steps = max(self.steps, 1)
            stats = {
                "comm_bytes_per_step": self.sent_bytes / steps,
                "comm_bytes_ratio": self.sent_bytes / self.dense_bytes,
            }
        self.sent_bytes = self.dense_bytes = self.steps = 0
        return stats
