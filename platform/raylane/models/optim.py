"""The configured optimizer, built the same way wherever parameters are updated (the workers,
or the parameter-server shards of asynchronous training).

Parameters are put in groups the optimizer's multi-tensor kernels can take whole. On CUDA,
AdamW defaults to its foreach path, which runs one op over a whole group: a group that mixes
DTensors (what a tensor-parallel plan or FSDP made of a block's weights) with plain tensors
(the embeddings and norms the plan left alone) stops at the first step with `got mixed
torch.Tensor and DTensor`, and DTensors of different meshes cannot meet in one op either. So
each group holds one kind: plain tensors of one device, or DTensors of one mesh. Groups of
plain CUDA tensors take the fused kernel (one launch for the whole update). On the CPU the
per-tensor path stays the default, so CPU runs step exactly as before.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Hashable, Iterable, Iterator

import torch

KINDS = ("adamw", "sgd")


def _group_key(param: torch.Tensor) -> Hashable:
    """Which group `param` belongs in: its DTensor mesh, or its device for a plain tensor. (No
    DTensor exists unless torch's DTensor module was imported: a data-parallel worker does
    not pay that import here.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(param, dtensor.DTensor):
        return ("dtensor", param.device_mesh)
    return ("plain", param.device)


def param_groups(params: Iterable[torch.nn.Parameter]) -> list[dict]:
    """`params` split into groups that never mix DTensors with plain tensors, meshes or devices
    (in order of first appearance, each group's parameters in their original order); plain
    CUDA groups marked `fused`."""
    groups: dict[Hashable, list[torch.nn.Parameter]] = {}
    for param in params:
        groups.setdefault(_group_key(param), []).append(param)
    found = []
    for (kind, where), members in groups.items():
        group: dict = {"params": members}
        if kind == "plain" and where.type == "cuda":
            group["fused"] = True
        found.append(group)
    return found


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    kind: str,
    lr: float,
    weight_decay: float,
    foreach: bool | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `kind` over `params` (grouped by `param_groups`). `foreach` forces the
    multi-tensor path of groups that are not fused (None: torch's choice for the device; a
    CPU test passes True to take the path CUDA takes)."""
    if kind not in KINDS:
        raise ValueError(f"unknown optimizer {kind!r}; available: {', '.join(KINDS)}")
    groups = param_groups(params)
    for group in groups:
        if foreach is not None and not group.get("fused"):
            group["foreach"] = foreach
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(groups, lr=lr, weight_decay=weight_decay)


#: A group's choice of update kernel: what this run's devices decide, not a checkpoint's.
KERNEL_OPTIONS = ("fused", "foreach")


@contextlib.contextmanager
def kernel_choice_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Load optimizer state inside this and each group keeps this run's `fused`/`foreach`:
    `load_state_dict` replaces a group's settings with the saved ones, so a checkpoint written
    on another device (or before CUDA groups were fused) would otherwise pick the kernels: a
    GPU run silently unfused, or a CPU run taking the fused CPU kernel."""
    chosen = [{k: g.get(k) for k in KERNEL_OPTIONS} for g in optimizer.param_groups]
    yield
    for group, options in zip(optimizer.param_groups, chosen, strict=True):
        group.update(options)
