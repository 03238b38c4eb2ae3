"""The protocol every parallelism strategy implements."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ParallelStrategy(Protocol):
    """Applies one way of parallelising to a plain model inside a Ray Train worker."""

    name: str

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Place the model on this worker's device and apply the strategy to it."""
        ...

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The plain module behind a wrapped one (what checkpoints and the registry hold)."""
        ...

    def train_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        inputs: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """Forward, backward and optimizer step on one batch; returns the (detached) loss."""
        ...
