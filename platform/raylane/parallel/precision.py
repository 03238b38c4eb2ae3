"""Mixed precision (`training.precision`): bf16 compute over fp32 master weights.

With 'bf16' every strategy runs its forward (and evaluation forward) under `torch.autocast`:
matrix multiplications and attention compute in bf16, numerically touchy ops (softmax, norms,
the loss) stay fp32, and the parameters, their gradients and the optimizer state stay fp32,
so the update is an fp32 update. FSDP2 also gathers its parameters in bf16
(`MixedPrecisionPolicy`, half the all-gather bytes) and reduce-scatters gradients in fp32. The
loss is taken on fp32 logits either way.

Whether bf16 is fast depends on the hardware: CPUs with avx512_bf16 or AMX have bf16 matrix
instructions; without them torch converts and computes in fp32, slower than plain fp32. Even
with them the casts cost more than they save on small matrices (`benchmarks/finetune.py`).

With 'tf32' everything is fp32 to the model and the optimizer, and the GPU's fp32 matrix
multiplications and convolutions run on its tensor cores in TF32 (10-bit mantissa inputs, fp32
accumulation; `apply_matmul_precision`): 2.6x fp32's tokens/s measured on an H200. It is a
GPU mode: the config refuses it on a CPU run.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: CPU flags (/proc/cpuinfo) that give bf16 matrix multiplications in hardware.
FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def apply_matmul_precision(precision: str) -> None:
    """Set this process's fp32 matmul mode for `precision` (call it on every worker before its
    first step): 'tf32' lets cuBLAS and cuDNN take TF32 tensor cores for fp32 matrices; any
    other precision leaves torch's defaults (fp32 matmuls in full fp32)."""
    if precision != "tf32":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context a forward runs in: bf16 autocast on `device`'s type, or nothing for fp32
    and tf32 (fp32 tensors; tf32 is a matmul mode, `apply_matmul_precision`)."""
    if precision != "bf16":
        return contextlib.nullcontext()
    device_type = device.type if isinstance(device, torch.device) else str(device)
    return torch.autocast(device_type, dtype=torch.bfloat16)


def autocast_method(owner: Any, name: str, precision: str, device: torch.device) -> None:
    """Run `owner.name` under `autocast` from now on (a pipeline stage's forward chunks: its
    schedule interleaves them with backward, which should not run under autocast)."""
    if precision != "bf16":
        return
    method = getattr(owner, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with autocast(precision, device):
            return method(*args, **kwargs)

    setattr(owner, name, wrapper)


def fp32_loss(loss_fn: Callable) -> Callable:
    """`loss_fn` on fp32 outputs (bf16 logits are cast up before the softmax)."""
    return lambda outputs, targets: loss_fn(outputs.float(), targets)


def fsdp_mixed_precision(precision: str):
    """FSDP2's policy for `precision`: None for fp32 and tf32; for bf16, parameters all-gathered
    and used in bf16, gradients reduce-scattered in fp32 (gloo does both: measured on torch
    2.13)."""
    if precision != "bf16":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def cpu_bf16_flags(cpuinfo: str) -> list[str]:
    """The `FAST_BF16_FLAGS` the first processor of a /proc/cpuinfo text has."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            return [flag for flag in FAST_BF16_FLAGS if flag in flags]
    return []


def bf16_speed(use_gpu: bool, cpuinfo_path: Path = Path("/proc/cpuinfo")) -> tuple[bool, str]:
    """Whether bf16 is fast on this machine, and one line saying so (for the console)."""
    if use_gpu:
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"bf16: {torch.cuda.get_device_name()} has bf16 tensor cores"
        return False, "bf16: no GPU with native bf16 here: bf16 emulated, expect it slow"
    try:
        flags = cpu_bf16_flags(cpuinfo_path.read_text())
    except OSError:
        return False, f"bf16: cannot read {cpuinfo_path}: bf16 speed on this CPU unknown"
    if flags:
        return True, (
            f"bf16: this CPU has {' and '.join(flags)}: bf16 matmuls in hardware, faster than "
            "fp32 once the matrices are large"
        )
    return False, (
        "bf16: this CPU has no avx512_bf16/AMX: bf16 emulated, expect it slower than fp32"
    )
