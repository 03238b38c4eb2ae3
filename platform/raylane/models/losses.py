"""The loss raylane trains and evaluates with, on plain tensors (no parallelism inside): the
strategies' steps take it, and the profile times the model's ends with it."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss every strategy's step takes: cross-entropy over the outputs' last dimension,
    which covers classification (`[B, C]` vs `[B]`) and language modelling (`[B, T, V]` vs
    `[B, T]`)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
