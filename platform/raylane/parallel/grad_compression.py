"""DDP gradient communication hooks that count what each worker sends.

Every scheme is a DDP communication hook. Each collective it issues adds the bytes of the
tensor this worker hands to it to a `CommMeter` (counted in the hook, not from a formula), and
each hook call marks the time its bucket's gradients were ready: after the last bucket, what
`backward()` still waits for is communication that did not overlap with compute.

Schemes: 'none' (fp32 all-reduce), 'fp16'/'bf16' (all-reduce in half precision), 'powersgd'
(torch's rank-r PowerSGD with error feedback) and 'topk' (the largest `topk_ratio` of each
bucket's entries, values and int32 indices all-gathered, the rest fed back into the next step).

The same schemes average one flat gradient buffer over a process group for the layouts that do
not use DDP (`GroupAverager`: the replicas of a tensor-parallel mesh): the same functions
compress, exchange and decompress, on a flat buffer instead of DDP's buckets. PowerSGD needs
DDP's buckets (their parameters' shapes), so it stays a DDP hook.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel


@dataclass
class CommMeter:
    """Bytes this worker handed to collectives, and when the last gradient bucket was ready."""

    sent_bytes: int = 0
    dense_bytes: int = 0  # what an fp32 all-reduce of the same buckets would have sent
    last_ready_s: float | None = None

    def sent(self, tensor: torch.Tensor) -> None:
        self.sent_bytes += tensor.numel() * tensor.element_size()

    def bucket_ready(self, bucket: dist.GradBucket) -> None:
        self.dense_bytes += bucket.buffer().numel() * 4
        self.last_ready_s = time.perf_counter()

    def take_last_ready(self) -> float | None:
        ready, self.last_ready_s = self.last_ready_s, None
        return ready


def take_comm_stats(meter: CommMeter, steps: int) -> dict[str, float]:
    """Bytes handed to gradient collectives per step, and against fp32's, since the last call
    (which this resets); {} where nothing was averaged."""
    stats = {}
    if meter.dense_bytes:
        stats = {
            "comm_bytes_per_step": meter.sent_bytes / max(steps, 1),
            "comm_bytes_ratio": meter.sent_bytes / meter.dense_bytes,
        }
    meter.sent_bytes = meter.dense_bytes = 0
    return stats


class _CountingDist:
    """`torch.distributed` as seen by torch's hook modules, with collectives counted."""

    def __init__(self, meter_of):
        self._meter_of = meter_of

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        meter = self._meter_of()
        if meter is not None:
            meter.sent(tensor)
        return dist.all_reduce(tensor, *args, **kwargs)


# torch's PowerSGD (and the plain all-reduce it starts with) call `dist.all_reduce` through
# their module's `dist`; one DDP model per worker process, so one meter at a time.
_ACTIVE: list[CommMeter] = []
powerSGD_hook.dist = _CountingDist(lambda: _ACTIVE[-1] if _ACTIVE else None)
default_hooks.dist = powerSGD_hook.dist


def _allreduce_mean(meter: CommMeter, tensor: torch.Tensor, group=None) -> torch.futures.Future:
    tensor.div_(dist.get_world_size(group))
    meter.sent(tensor)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def fp32_hook(meter: CommMeter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    meter.bucket_ready(bucket)
    return _allreduce_mean(meter, bucket.buffer()).then(lambda fut: fut.value()[0])


def half_average(
    meter: CommMeter, buffer: torch.Tensor, dtype: torch.dtype, group=None
) -> torch.futures.Future[torch.Tensor]:
    """Average `buffer` over `group` in half precision; the future's value is `buffer`."""
    compressed = buffer.to(dtype)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return _allreduce_mean(meter, compressed, group).then(decompress)


def _half_hook(dtype: torch.dtype):
    def hook(meter: CommMeter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        meter.bucket_ready(bucket)
        return half_average(meter, bucket.buffer(), dtype)

    return hook


HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HALF_HOOKS = {name: _half_hook(dtype) for name, dtype in HALF_DTYPES.items()}


@dataclass
class TopKState:
    """Top-k sparsification with error feedback: what a step leaves out is added to the next.
    The residual is kept per parameter (by `id`), so it follows each parameter into whatever
    bucket holds it next: DDP rebuilds its buckets after the first step, in another order."""

    meter: CommMeter
    ratio: float
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.meter.bucket_ready(bucket)
    pieces = [(id(p), p.numel()) for p in bucket.parameters()]
    return topk_average(state, bucket.buffer(), pieces)


def topk_average(
    state: TopKState, buffer: torch.Tensor, pieces: list[tuple[int, int]], group=None
) -> torch.futures.Future[torch.Tensor]:
    """Average the top-k of `buffer` (plus what earlier steps left out of each of its
    `pieces`: `(key, numel)` in buffer order) over `group`; the future's value is `buffer`."""
    accumulated = buffer.clone()
    offset = 0
    for key, numel in pieces:
        residual = state.residuals.get(key)
        if residual is not None:
            accumulated[offset : offset + numel] += residual
        offset += numel
    k = max(1, int(buffer.numel() * state.ratio))
    indices = accumulated.abs().topk(k, sorted=False).indices
    values = accumulated[indices]
    accumulated[indices] = 0
    for (key, _), part in zip(pieces, accumulated.split([n for _, n in pieces]), strict=True):
        state.residuals[key] = part
    payload = torch.cat([values, indices.to(torch.int32).view(values.dtype)])
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    state.meter.sent(payload)
    future = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()

    def decompress(_):
        buffer.zero_()
        for part in gathered:
            buffer.index_add_(0, part[k:].view(torch.int32).long(), part[:k])
        return buffer.div_(world)

    return future.then(decompress)


def _powersgd_hook(meter: CommMeter):
    # Short runs: start compressing after 2 plain all-reduces (torch's default waits 1,000).
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
    )

    def hook(state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket):
        meter.bucket_ready(bucket)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    return state, hook


def register_compression(model, method: str, topk_ratio: float = 0.01) -> CommMeter:
    """Register the hook for `method` on a DDP model; return the meter it counts into.

    A model that is not wrapped in DDP (a single worker) all-reduces nothing: the meter stays 0.
    """
    meter = CommMeter()
    if not isinstance(model, DistributedDataParallel):
        return meter
    _ACTIVE[:] = [meter]
    if method == "none":
        model.register_comm_hook(meter, fp32_hook)
    elif method in ("fp16", "bf16"):
        model.register_comm_hook(meter, HALF_HOOKS[method])
    elif method == "powersgd":
        model.register_comm_hook(*_powersgd_hook(meter))
    elif method == "topk":
        model.register_comm_hook(TopKState(meter, topk_ratio), topk_hook)
    else:
        raise ValueError(f"unknown gradient compression {method!r}")
    return meter


class GroupAverager:
    """Averages a flat gradient buffer over `group` with `method` ('none', 'fp16', 'bf16',
    'topk'), as DDP's hook of the same name averages a bucket; counts bytes in `meter`."""

    def __init__(self, method: str, group, topk_ratio: float = 0.01):
        if method not in ("none", "topk", *HALF_HOOKS):
            raise ValueError(
                f"gradient compression {method!r} needs DDP's buckets; a flat buffer takes "
                "'none', 'fp16', 'bf16' or 'topk'"
            )
        self.method, self.group = method, group
        self.meter = CommMeter()
        self.topk = TopKState(self.meter, topk_ratio)

    def __call__(self, flat: torch.Tensor) -> None:
        """Replace `flat` by its (compressed) average over the group."""
        self.meter.dense_bytes += flat.numel() * 4
        if self.method == "none":
            future = _allreduce_mean(self.meter, flat, self.group)
        elif self.method == "topk":
            future = topk_average(self.topk, flat, [(0, flat.numel())], self.group)
        else:
            future = half_average(self.meter, flat, HALF_DTYPES[self.method], self.group)
        future.wait()
