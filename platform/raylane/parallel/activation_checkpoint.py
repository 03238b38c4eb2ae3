"""Activation checkpointing: recompute each transformer block in backward instead of keeping
its activations. Applied by replacing the blocks' `forward`, so parameter names (checkpoints,
the registry, pipeline stages) stay those of the plain model."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Checkpoint every block of a GPT-style model's `blocks`; returns the same model."""
    for block in model.blocks.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model
