"""Where a worker's tensors live: one answer for every strategy, the loop and the profile.

A tensor that meets a model or a collective must be created on (or copied to) the device the
other side is on: NCCL has no CPU backend (`No backend type associated with device type cpu`),
and a CUDA model refuses CPU inputs. So factories take `device=`, and the device comes from
here: the worker's own (`worker_device`), or the one a process group's collectives run on
(`collective_device`). Torch-only at import (Ray is imported by the function that asks it), so
`benchmarks/gpu.py` can use it on a machine without Ray.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def worker_device(use_gpu: bool) -> torch.device:
    """This worker's device: the GPU Ray Train assigned it (`parallelism.use_gpu`), else the
    CPU. Also makes it the current CUDA device, so that `collective_device` and kernels
    launched without an explicit device agree with it."""
    if not use_gpu:
        return CPU
    from ray.train.torch import get_device

    device = get_device()
    if isinstance(device, list):  # several GPUs per worker: the first one computes
        device = device[0]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors `group`'s collectives take: the current CUDA device under
    NCCL, else the CPU (gloo; no process group at all)."""
    if not (dist.is_available() and dist.is_initialized()):
        return CPU
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return CPU


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`. A host tensor bound for a GPU is copied from pinned memory without
    blocking the host (the copy overlaps whatever the GPU still has queued, and the pinned
    buffer is held by torch's caching host allocator until the copy is done)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a CUDA device; nothing to wait for on the CPU):
    what a timing must do before it reads the clock, or it times the launches."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_scalars(values: Sequence[float | torch.Tensor], op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce a few numbers over the default group in one float64 collective on its device,
    and return them to the host (the one sync). Entries may be Python numbers or one-element
    tensors on any device (sums kept on the GPU through an epoch). Without a process group,
    the values themselves."""
    device = collective_device()
    parts = [
        v.detach().to(device=device, dtype=torch.float64).reshape(1)
        if torch.is_tensor(v)
        else torch.tensor([float(v)], dtype=torch.float64, device=device)
        for v in values
    ]
    stacked = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stacked, op=op)
    return stacked.tolist()


def peak_device_memory_bytes(device: torch.device | str) -> int | None:
    """Bytes the caching allocator has held for tensors on `device` at most so far (what
    must fit in the GPU's memory); None on the CPU (its figure is the process's RSS)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device)


class StreamClock:
    """Time points on a device's stream: CUDA events recorded where the work is queued (a
    host clock would read when the launch happened, not when the kernel ran), or the host's
    `perf_counter` on the CPU. `seconds(a, b)` waits for `b` and returns the time between."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000
