"""The configured optimizer, built the same way wherever parameters are updated (the workers,
or the parameter-server shards of asynchronous training)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def build_optimizer(
    params: Iterable[torch.nn.Parameter], kind: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {kind!r}; available: adamw, sgd")
