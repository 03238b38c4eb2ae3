"""A LoRA run's frozen base held in bf16 (`finetune.base_dtype`): half the base's bytes, the
model still computing in its own dtype.

`hold_frozen` casts the weights of every frozen `nn.Linear` and `nn.Embedding` (the bulk of a
decoder's parameters: projections, MLPs, embedding, head) and swaps their class for one that
casts the weight to the input's dtype as it is used. A frozen linear's backward needs only
its weight (no weight gradient): `_FrozenLinear` keeps the bf16 weight for it, not the cast
copy, so no fp32 copy of a weight outlives its layer's forward or backward. The norms (a few
thousand parameters) and every trainable parameter (the adapters) stay fp32, so the optimizer
state is fp32. Nothing changes in the state dict: the same names, the base's in bf16.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class _FrozenLinear(torch.autograd.Function):
    """`x @ weight.T + bias` in `x`'s dtype, the gradient to `x` alone (weight and bias are
    frozen), keeping the stored (bf16) weight for the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        dtype = compute_dtype(x)
        return F.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `x`'s matrix products run in: autocast's where it is on (no cast up to `x`'s
    dtype and back down), else `x`'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class FrozenLinear(nn.Linear):
    """An `nn.Linear` whose frozen weight is stored in a narrower dtype than it computes in.
    `compute_dtype` is what PEFT reads to keep the adapters it adds in that dtype."""

    compute_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenLinear.apply(x, self.weight, self.bias)


class FrozenEmbedding(nn.Embedding):
    """An `nn.Embedding` whose frozen table is stored narrower: rows are looked up, then cast
    to `compute_dtype`."""

    compute_dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.compute_dtype)


def hold_frozen(model: nn.Module, dtype: torch.dtype, compute: torch.dtype) -> int:
    """Hold the weights of `model`'s frozen linears and embeddings in `dtype` (in place),
    computing in `compute`; every trainable parameter (an adapter's linears) and every other
    module's in `compute`. Before `apply_lora` (the base frozen first), the adapters PEFT adds
    are made in `compute` (it reads the layer's `compute_dtype`), their random start never
    rounded to `dtype`. Returns the bytes the held weights take."""
    for module in model.modules():
        kind = {nn.Linear: FrozenLinear, nn.Embedding: FrozenEmbedding}.get(type(module))
        if kind is None or any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        module.__class__ = kind
        module.compute_dtype = compute
    held: dict[int, int] = {}
    for module in model.modules():
        narrow = isinstance(module, FrozenLinear | FrozenEmbedding)
        for parameter in module.parameters(recurse=False):
            parameter.data = parameter.data.to(dtype if narrow else compute)
            if narrow:  # a tied head and embedding are one tensor, counted once
                held[id(parameter)] = parameter.numel() * parameter.element_size()
    return sum(held.values())
