"""Data parallelism: every worker holds the whole model; gradients are all-reduced (DDP)."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylane.config import RaylaneConfig
from raylane.parallel.base import LossFn, StrategyDefaults


class DataParallel(StrategyDefaults):
    """DistributedDataParallel set up by Ray Train (gloo on CPU, NCCL on GPU)."""

    name = "ddp"
    splits_dataset = True
    data_rank, data_world = 0, 1
    reports_loss = True
    checkpoint_part = 0

    def __init__(self, cfg: RaylaneConfig, rank: int):
        self.saves_checkpoint = rank == 0
        self.grad_compression = cfg.parallelism.grad_compression
        self.topk_ratio = cfg.parallelism.topk_ratio
        self.last_step_parts: dict[str, float] = {}
        self.steps = 0

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from ray.train.torch import prepare_model

        # prepare_model moves the model to the worker's device and wraps it in DDP when the
        # worker group has more than one worker.
        from raylane.parallel.grad_compression import register_compression

        model = prepare_model(model, parallel_strategy="ddp")
        self.meter = register_compression(model, self.grad_compression, self.topk_ratio)
        self.device = next(model.parameters()).device
        return model

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def train_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        inputs: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs.to(self.device)), targets.to(self.device))
        backward_started = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        done = time.perf_counter()
        # After the last gradient bucket was ready, backward only waited for all-reduces.
        ready = self.meter.take_last_ready()
        exposed = backward_done - ready if ready is not None and ready > backward_started else 0
        self.last_step_parts = {"compute": done - started - exposed, "comm": exposed}
        self.steps += 1
        return loss.detach()

    def epoch_stats(self) -> dict[str, float]:
        """Bytes this worker handed to gradient collectives per step, against fp32's."""
        meter, steps = self.meter, max(self.steps, 1)
        stats = {}
        if meter.dense_bytes:
            stats = {
                "comm_bytes_per_step": meter.sent_bytes / steps,
                "comm_bytes_ratio": meter.sent_bytes / meter.dense_bytes,
            }
        meter.sent_bytes = meter.dense_bytes = self.steps = 0
        return stats
