"""A residual MLP for the digits (8x8 images given as 64 features): a model of your own,
trained by raylane with `model.kind: custom` (configs/train/digits_custom.yaml).

raylane imports `residual_mlp` from the working directory (or an installed package), calls it
with `model.args`, and trains what it returns. Its repeated `ResidualBlock`s are what FSDP
shards one at a time, activation checkpointing recomputes and `training.compile` compiles;
`block_plan` below is its tensor-parallel plan, which `ResidualMLP.tp_plan` names.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F


class ResidualBlock(nn.Module):
    """Pre-norm MLP block: x + down(gelu(up(norm(x))))."""

    def __init__(self, width: int, expansion: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, expansion * width)
        self.down = nn.Linear(expansion * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """Feature rows -> width -> `depth` residual blocks -> class logits."""

    #: The module whose `block_plan` splits each block over tensor-parallel workers: this one.
    tp_plan = __name__

    def __init__(
        self, input_dim: int, num_classes: int, width: int, depth: int, input_scale: float
    ):
        super().__init__()
        self.input_scale = input_scale  # digits pixels are 0-16: clients send them raw
        self.embed = nn.Linear(input_dim, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x / self.input_scale)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))


def residual_mlp(
    input_dim: int = 64,
    num_classes: int = 10,
    width: int = 128,
    depth: int = 3,
    input_scale: float = 16.0,
    label_smoothing: float = 0.0,
):
    """The model; with `label_smoothing`, also the loss to train it with (a pair)."""
    model = ResidualMLP(input_dim, num_classes, width, depth, input_scale)
    if not label_smoothing:
        return model
    return model, functools.partial(F.cross_entropy, label_smoothing=label_smoothing)


def block_plan(sequence_parallel: bool = False) -> dict:
    """Each block's MLP split over the tensor-parallel workers (Megatron's): `up` by output
    columns, `down` by input rows, so a block needs one all-reduce forward and one backward.
    The norm stays whole on every worker."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}
