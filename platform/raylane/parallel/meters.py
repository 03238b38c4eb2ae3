"""Measurements of a worker: a pipeline stage's compute time per step, the activation memory
autograd holds, and the bytes of model state (parameters, gradients, optimizer state) it keeps."""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from raylane.parallel.device import peak_device_memory_bytes


class StageTimer:
    """Accumulates the time a stage spends computing (its forward and backward chunks) against
    the wall time of the steps; the difference is time spent waiting: the bubble. The
    schedule's gradient reduction after a step's last backward (the replicas' all-reduce) is
    timed apart, as communication (`sync_s`)."""

    COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    SYNC_METHOD = "perform_reduce_grad"

    def __init__(self):
        self.reset()
        self._paused = False

    def reset(self) -> None:
        self.busy_s = 0.0
        self.sync_s = 0.0
        self.wall_s = 0.0
        self.steps = 0

    def instrument(self, stage) -> None:
        for name in self.COMPUTE_METHODS:
            if hasattr(stage, name):
                setattr(stage, name, self._timed(getattr(stage, name), "busy_s"))
        sync = getattr(stage, self.SYNC_METHOD, None)
        if sync is not None:
            setattr(stage, self.SYNC_METHOD, self._timed(sync, "sync_s"))

    def _timed(self, method, total: str):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if not self._paused:
                    setattr(self, total, getattr(self, total) + time.perf_counter() - start)

        return wrapper

    def end_step(self, wall_s: float) -> None:
        self.wall_s += wall_s
        self.steps += 1

    @contextlib.contextmanager
    def paused(self):
        """Evaluation forwards do not count towards the training bubble."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this worker stores for a tensor (a DTensor's local shard only)."""
    # lazy: collectives imports DTensor (about 0.5 s per worker) that plain DDP never needs
    from raylane.parallel.collectives import local_tensor

    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes held by this worker (its shards only)."""
    params = list(model.parameters())
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if torch.is_tensor(value)
    ]
    return {
        "param": sum(local_bytes(p) for p in params),
        "grad": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_state": sum(local_bytes(v) for v in state),
    }


def worker_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    activations: ActivationMeter,
    device: torch.device,
) -> dict[str, int]:
    """This worker's model state and activation peak (bytes), and on a GPU the most device
    memory its allocator has held so far (`device_peak`: what must fit in the GPU; a CPU
    run's counterpart is the process's peak RSS)."""
    memory = {**model_state_bytes(model, optimizer), "activation_peak": activations.peak_bytes}
    device_peak = peak_device_memory_bytes(device)
    if device_peak is not None:
        memory["device_peak"] = device_peak
    return memory


class _Held:
    """A tensor saved for backward; counts its bytes as held until autograd releases it."""

    __slots__ = ("meter", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter):
        self.tensor = tensor
        self.meter = meter
        self.nbytes = local_bytes(tensor)
        meter.add(self.nbytes)

    def __del__(self):
        self.meter.add(-self.nbytes)


class ActivationMeter:
    """Peak bytes of activations autograd holds for backward during a step.

    Parameters (leaf tensors that require grad) are not counted: they are held anyway. GPipe
    holds every micro-batch's activations before the first backward; 1F1B at most about `pp`.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _pack(self, tensor: torch.Tensor):
        if tensor.is_leaf and tensor.requires_grad:
            return tensor
        return _Held(tensor, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Held) else saved

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
