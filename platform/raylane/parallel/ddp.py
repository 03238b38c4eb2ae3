"""Data parallelism: every worker holds the whole model; gradients are all-reduced (DDP)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylane.config import RaylaneConfig
from raylane.parallel.base import LossFn


class DataParallel:
    """DistributedDataParallel set up by Ray Train (gloo on CPU, NCCL on GPU)."""

    name = "ddp"
    splits_dataset = True
    data_rank, data_world = 0, 1
    reports_loss = True
    checkpoint_part = 0

    def __init__(self, cfg: RaylaneConfig, rank: int):
        self.saves_checkpoint = rank == 0
        self.grad_compression = cfg.parallelism.grad_compression

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from ray.train.torch import prepare_model

        # prepare_model moves the model to the worker's device and wraps it in DDP when the
        # worker group has more than one worker.
        from raylane.parallel.grad_compression import register_compression

        model = prepare_model(model, parallel_strategy="ddp")
        register_compression(model, self.grad_compression)
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
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs.to(self.device)), targets.to(self.device))
        loss.backward()
        optimizer.step()
        return loss.detach()

    def forward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        return model(inputs.to(self.device)).cpu()

    def epoch_stats(self) -> dict[str, float]:
        return {}
