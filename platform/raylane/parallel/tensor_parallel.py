"""Tensor parallelism (Megatron style) with DTensor plans, and `dp` replicas of it.

In every transformer block the query, key and value projections and the MLP's first linear are
split column-wise (each of the `tp` workers holds n_heads / tp whole heads and 4·d / tp hidden
units) and the attention output and MLP's second linear row-wise, whose partial sums are
all-reduced: one all-reduce per half-block forward, one backward. Embeddings, norms and the
head are replicated on the tp workers; their inputs and gradients are the same there, so they
stay equal without communication. Replicas (dp > 1) average their gradients (their shards of
them) before each optimizer step. The tp workers of one replica read the same batches.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from raylane.config import RaylaneConfig
from raylane.config.dims import ParallelDims
from raylane.parallel.base import StrategyDefaults
from raylane.parallel.collectives import average_gradients
from raylane.parallel.mesh import build_device_mesh


def block_plan() -> dict:
    """How one `raylane.models.gpt.Block` is split: module name -> style."""
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split every block of a GPT over `tp_mesh` (in place)."""
    if tp_mesh.size() > 1:
        for block in model.blocks.values():
            parallelize_module(block, tp_mesh, block_plan())
    return model


class TensorParallel(StrategyDefaults):
    """`tp` workers per model, `dp` replicas (workers = dp * tp)."""

    splits_dataset = False
    #: Every worker writes its shards (torch distributed checkpoint), rank 0 the whole model.
    sharded_checkpoint = True
    checkpoint_part = 0

    def __init__(self, cfg: RaylaneConfig, rank: int):
        par = cfg.parallelism
        self.name = par.strategy
        self.device = torch.device("cuda" if par.use_gpu else "cpu")
        self.mesh = build_device_mesh(ParallelDims.from_parallelism(par), self.device.type)
        self.dp, self.tp = self.mesh.dp, self.mesh.tp
        self.dp_rank, self.tp_rank = self.mesh.dp_rank, self.mesh.tp_rank
        self.data_rank, self.data_world = self.dp_rank, self.dp
        # The tp workers of a replica compute the same loss; one of them reports it.
        self.reports_loss = self.tp_rank == 0
        self.saves_checkpoint = True
        self.writes_part = rank == 0  # the assembled model
        self.last_step_parts: dict[str, float] = {}

    def _place(self) -> None:
        if self.device.type == "cuda":
            from ray.train.torch import get_device

            self.device = get_device()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._place()
        return apply_tensor_parallel(model.to(self.device), self.mesh.tp_mesh)

    def sync_gradients(self, model: nn.Module) -> None:
        # The tensor-parallel all-reduces run inside forward and backward: counted as compute.
        if self.dp > 1:
            average_gradients(model, self.mesh.dp_group, self.dp)

    def forward(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor | None:
        outputs = model(inputs.to(self.device)).cpu()  # every tp worker takes part
        return outputs if self.reports_loss else None
