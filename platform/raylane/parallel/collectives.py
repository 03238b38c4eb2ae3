"""Gradient averaging over a data-parallel group, for strategies that do not use DDP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this worker holds of a tensor: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def average_gradients(
    module: nn.Module,
    group: dist.ProcessGroup,
    world: int,
    averager: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """All-reduce the module's gradients (this worker's shards of them) over the replicas in
    `group`, in one buffer; `averager` replaces the plain mean (a compressed one,
    `raylane.parallel.grad_compression.GroupAverager`)."""
    grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    if averager is None:
        dist.all_reduce(flat, group=group)
        flat /= world
    else:
        averager(flat)
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(averaged)
