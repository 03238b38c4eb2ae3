"""INT8 weights for serving a GPT (`serving.quantization: int8`), with torchao.

Every linear layer (attention projections, MLP, head) keeps its weights as int8 with one
scale per output channel (torchao's weight-only int8), and so do the token and position
embeddings (one scale per row: a looked-up row is dequantized alone). Activations stay fp32,
as do layer norms and biases, a small part of the bytes. In a small byte-level GPT the
embeddings are a large share (two 256 x d tables beside 12·d² per block): with them in fp32 the
weights shrink to 0.33 of fp32's, with them in int8 to 0.27. The model stays a plain module:
KV-cache decoding and continuous batching run on it unchanged.

Quantize after the model is on its device and in its dtype (`raylane.serving.generation.placement`):
torchao quantizes each weight where it is, so the int8 data and scales are made on the GPU, and
scales follow the weights' dtype (bf16 activations with int8 weights are torchao's own case).
"""

from __future__ import annotations

import io
import math

import torch
from torch import nn


def quantize_int8(model: nn.Module) -> nn.Module:
    """`model` with int8 weight-only linear layers and embeddings, on the device and in the
    dtype its weights have now (in place; returned for chaining)."""
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, _: isinstance(m, nn.Linear))
    per_row = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    quantize_(model, per_row, filter_fn=lambda m, _: isinstance(m, nn.Embedding))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as saved (int8 data, scales and fp32 parts together)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


@torch.no_grad()
def bits_per_byte(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean next-byte cross-entropy in bits over windows `tokens` `[N, T]` / `labels` `[N, T]`."""
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return float(loss) / math.log(2.0)
