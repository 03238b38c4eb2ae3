"""Where and how a served language model computes: its device, its dtype and its weights' format.

A replica that asked Ray for GPUs (`serving.replica_gpus`) sees them as CUDA devices and puts its
model there; otherwise it stays on the host. `serving.dtype: bf16` casts weights (and so the KV
cache, which takes the model's dtype) to bfloat16; `serving.quantization: int8` then stores the
weights as int8 on that device (torchao quantizes tensors where they are, so quantizing after
the move makes int8 data on the GPU, with bf16 scales under bf16). Torch only: the GPU benchmark
places models with these functions on a machine without Ray or pydantic.
"""

from __future__ import annotations

import torch
from torch import nn

from raylane.serving.generation.quantize import quantize_int8

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def serving_device(gpus: float) -> torch.device:
    """`cuda` for a replica given GPUs (Ray makes them the only visible ones), else `cpu`.

    Raises:
        RuntimeError: GPUs were asked for but torch sees none (a CPU-only torch build, or no
            driver on the node).
    """
    if gpus <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"serving.replica_gpus is {gpus:g} but torch {torch.__version__} sees no CUDA "
            "device on this node (install the CUDA build of torch, or set replica_gpus: 0)"
        )
    return torch.device("cuda", torch.cuda.current_device())


def place_model(
    model: nn.Module, device: torch.device | str, dtype: str = "fp32", quantization: str = "none"
) -> nn.Module:
    """`model` (a whole GPT) in eval mode on `device`, its weights in `dtype` ('fp32' or
    'bf16'), then int8 when `quantization` is 'int8' (in place; returned for chaining).

    Raises:
        ValueError: an unknown dtype or quantization.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if quantization not in ("none", "int8"):
        raise ValueError(f"quantization must be 'none' or 'int8', not {quantization!r}")
    model.to(device=device, dtype=DTYPES[dtype])
    if quantization == "int8":
        quantize_int8(model)
    return model.eval()
