"""Data parallelism: every worker holds the whole model; gradients are all-reduced (DDP)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylane.config import RaylaneConfig
from raylane.parallel.base import WholeModelReplica
from raylane.parallel.grad_compression import register_compression, take_comm_stats


class DataParallel(WholeModelReplica):
    """DistributedDataParallel over Ray Train's process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, cfg: RaylaneConfig, rank: int):
        super().__init__(cfg, rank)
        self.grad_compression = cfg.parallelism.grad_compression
        self.topk_ratio = cfg.parallelism.topk_ratio

    def wrap_model(self, model: nn.Module) -> nn.Module:
        # DDP is `parallelize`'s last step (one worker: the model itself); the hook that
        # all-reduces each bucket, compressed or not, counts what it sends.
        model = self.place(model, all_reduce=True)
        self.meter = register_compression(model, self.grad_compression, self.topk_ratio)
        return model

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def backward_comm_s(self, backward_started: float, backward_done: float) -> float:
        # After the last gradient bucket was ready, backward only waited for all-reduces.
        ready = self.meter.take_last_ready()
        return backward_done - ready if ready is not None and ready > backward_started else 0.0

    def epoch_stats(self) -> dict[str, float]:
        """Bytes this worker handed to gradient collectives per step, against fp32's."""
        stats, self.steps = take_comm_stats(self.meter, self.steps), 0
        return stats
