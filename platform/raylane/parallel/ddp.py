"""Data parallelism: every worker holds the whole model; gradients are all-reduced (DDP)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylane.parallel.base import LossFn


class DataParallel:
    """DistributedDataParallel set up by Ray Train (gloo on CPU, NCCL on GPU)."""

    name = "ddp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from ray.train.torch import prepare_model

        # prepare_model moves the model to the worker's device and wraps it in DDP when the
        # worker group has more than one worker.
        return prepare_model(model, parallel_strategy="ddp")

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
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
