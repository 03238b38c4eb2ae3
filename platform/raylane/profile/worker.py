"""Profile once: what a model's parts cost to compute and hold, and what the cluster's links
cost, measured by a short Ray Train job on the cluster itself.

For every worker count `k` a search may use (the concurrency levels), the first `k` workers of
the job measure at the same time, with the torch threads a `k`-worker run gets, so that workers
sharing a node's cores are measured sharing them:

* one transformer block's forward+backward and forward alone, and the model's ends (embeddings,
  final norm, head and loss), at a few row counts, fitted as fixed + per-row seconds;
* an optimizer step, per parameter;
* an all-reduce over the `k` workers at several sizes, fitted as alpha + beta * bytes;
* the whole model under DistributedDataParallel over the `k` workers, timed as raylane's data
  parallel strategy times it: what backward waits for after its last gradient bucket is ready
  (the all-reduce, the hook, and the workers' skew), at a few row counts;
* torch's pipeline schedules (GPipe and 1F1B) between ranks 0 and 1 on a one-layer stage at a
  few micro-batch counts: the schedule's own cost per micro-batch (sends, receives, its Python);
* one block as each sharded layout of `k` workers wraps it (tensor parallel, FSDP, both), built
  by the runs' own `parallelize` and timed at the same row counts (`raylane.profile.layouts`);
* a push of the model's gradients to a parameter shard (the async and ssp strategies' own
  actor) and the parameters' return, all `k` workers pushing at once.

The blocks (plain and wrapped) and the optimizer are timed at the level's start and again at
its end, and the faster of the two is kept (`_keep_faster`).

Once, at full concurrency: a point-to-point exchange between ranks 0 and 1 (alpha + beta), the
bytes autograd saves per row in a block and in the ends with the loss (fp32 logits and their
log-softmax), and the worker's resident memory before any model exists, for `raylane.plan.measured`.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from raylane.config import RaylaneConfig
from raylane.models import build_model
from raylane.models.classifier import build_with_blocks
from raylane.models.families import shape_of
from raylane.models.losses import cross_entropy
from raylane.models.optim import build_optimizer
from raylane.parallel.device import synchronize, worker_device
from raylane.parallel.precision import apply_matmul_precision
from raylane.plan.fits import block_train_flops, compute_fit, link_fit
from raylane.profile.layouts import (
    build_meshes,
    one_block,
    start_param_server,
    time_ddp,
    time_param_server,
    time_schedules,
    time_wrapped_blocks,
)
from raylane.profile.links import time_all_reduce, time_p2p
from raylane.runtime import worker_threads

ROWS = (2, 8, 32)
MICROBATCHES = (2, 8)
SCHEDULE_ROWS = 2
REPEATS = 5
WARMUP = 3
SETTLE_S = 3.0


def _median_s(
    step: Callable[[], None],
    repeats: int = REPEATS,
    sync: Callable[[], None] | None = None,
    device=None,
) -> float:
    """Median seconds of `step`. With `sync` (a barrier of the workers measuring together),
    every repetition starts on all of them at once, as a run's steps do, so that each is timed
    sharing the cores with the others' same work rather than with whatever they are at. On a
    CUDA `device` the clock is read after the queued work is done (`synchronize`), not when
    its kernels were launched."""
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        if device is not None:
            synchronize(device)
        started = time.perf_counter()
        step()
        if device is not None:
            synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@dataclass(frozen=True)
class _Timer:
    """`_median_s` on one worker's device: what every measurement of the profile times with."""

    device: Any

    def __call__(self, step, repeats: int = REPEATS, sync=None) -> float:
        return _median_s(step, repeats, sync, self.device)


def _parts(cfg):
    """A block and the model's ends (the model without blocks), as the training run builds
    them, for any family (`one_block`)."""
    return one_block(cfg.model), build_with_blocks(cfg.model, 0)


def _hidden(cfg, rows: int, device):
    """Hidden states a block takes: `rows` sequences of the run's length, the family's width."""
    import torch

    width = shape_of(cfg.model).d_model
    return torch.randn(rows, cfg.model.input_dim, width, device=device, requires_grad=True)


def _time_compute(cfg, median_s, device, sync=None) -> dict[str, dict[int, float]]:
    import torch

    m = cfg.model
    block, ends = (part.to(device) for part in _parts(cfg))
    found: dict[str, dict[int, float]] = {"block": {}, "block_forward": {}, "ends": {}}
    for rows in ROWS:
        hidden = _hidden(cfg, rows, device)
        tokens = torch.randint(0, m.num_classes, (rows, m.input_dim), device=device)

        def train_block(hidden=hidden):
            block(hidden).sum().backward()

        def forward_block(hidden=hidden):
            with torch.no_grad():
                block(hidden)

        def train_ends(tokens=tokens):
            cross_entropy(ends(tokens), tokens).backward()

        found["block"][rows] = median_s(train_block, sync=sync)
        found["block_forward"][rows] = median_s(forward_block, sync=sync)
        found["ends"][rows] = median_s(train_ends, sync=sync)
    return found


def _time_optimizer(cfg, median_s, device, sync=None) -> float:
    """Seconds per parameter of one optimizer step (timed with a refill of the gradients)."""
    import torch

    model = build_model(cfg.model).to(device)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    training = cfg.training
    optimizer = build_optimizer(params, training.optimizer, training.lr, training.weight_decay)

    def step():
        optimizer.step()
        for p in params:
            p.grad.normal_()

    return median_s(step, sync=sync) / sum(p.numel() for p in params)


def _saved_bytes_per_row(module, make_input) -> float:
    """Bytes autograd saves for backward in one forward, per row (from two row counts), on
    the device `module` and its inputs are on (the attention kernel, and so what it saves,
    is the device's)."""
    import torch

    def saved(rows: int) -> int:
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            module(make_input(rows))
        return total

    return (saved(8) - saved(4)) / 4


def profile_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """What each Ray Train worker of the profile job runs; rank 0 returns the figures (the
    median over the workers that measured). Everything is measured on the worker's device
    (its GPU with `parallelism.use_gpu`, collectives over NCCL), in the run's matmul mode."""
    import ray.train
    import torch
    import torch.distributed as dist

    # The worker group's start-up (its processes importing, Ray Train's controller) holds the
    # cores for the first seconds; measuring then would read several times too slow.
    time.sleep(SETTLE_S)
    baseline_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cfg = RaylaneConfig.model_validate(loop_config["config"])
    device = worker_device(cfg.parallelism.use_gpu)
    apply_matmul_precision(cfg.training.precision)
    levels: list[int] = loop_config.get("concurrency") or [cfg.parallelism.workers]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(cfg.training.seed)
    distributed = world > 1 and dist.is_initialized()
    # Every group up front (creating one is collective); ranks sit out a level sleeping on
    # the store, so that they leave the cores to the ranks measuring.
    groups = {k: dist.new_group(list(range(k))) for k in levels if distributed and k > 1}
    pair = groups.get(2) or (dist.new_group([0, 1]) if distributed else None)
    splits = shape_of(cfg.model).splits_over(2)
    ring = cfg.model.input_dim % 4 == 0  # 2 ring workers, each 2 of 4 chunks of every row
    meshes = build_meshes(world, levels, splits, device.type, ring) if distributed else {}
    shard = start_param_server(cfg, rank, distributed)
    mine: dict[str, Any] = {"baseline_rss_mb": baseline_rss_mb, "levels": {}}
    if device.type == "cuda":  # what the device holds before any model: the GPU's baseline
        mine["baseline_device_mb"] = torch.cuda.memory_allocated(device) / 2**20
    median_s = _Timer(device)
    for k in levels:
        if rank < k:
            torch.set_num_threads(worker_threads(cfg, k))
            level = _measure_level(cfg, k, rank, groups, pair, meshes.get(k), shard, median_s)
            mine["levels"][k] = level
        _wait_for_level(rank, k, distributed)
    torch.set_num_threads(worker_threads(cfg, world))
    if distributed:
        dist.barrier()
        mine["p2p"] = time_p2p(rank, median_s)
        gathered: list[dict] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    return summarise(gathered, cfg, device)


def _measure_level(cfg, k: int, rank: int, groups, pair, meshes, shard, median_s) -> dict:
    """What one of the first `k` ranks measures at the level of `k` workers (`median_s`: the
    timer on the worker's device, `_Timer`)."""
    device = median_s.device
    sync = _barrier(groups.get(k))
    level = _time_blocks(cfg, meshes, sync, median_s)
    if k in groups:
        level["all_reduce"] = time_all_reduce(groups[k], median_s)
        level["ddp"] = time_ddp(cfg, groups[k], ROWS, REPEATS, device)
    level["ps_push"] = time_param_server(cfg, shard, median_s, sync)
    if k >= 2 and rank < 2:
        level["schedules"] = time_schedules(
            cfg, rank, pair, MICROBATCHES, SCHEDULE_ROWS, median_s, device
        )
    _keep_faster(level, _time_blocks(cfg, meshes, sync, median_s))
    return level


def _time_blocks(cfg, meshes: dict | None, sync, median_s) -> dict[str, Any]:
    """A level's block timings: the plain block's parts and the optimizer per parameter, and
    with `meshes` each block as the level's sharded layouts wrap it, and its optimizer step."""
    device = median_s.device
    timed = {
        "compute": _time_compute(cfg, median_s, device, sync),
        "optimizer": _time_optimizer(cfg, median_s, device, sync),
    }
    if meshes:
        timed["wrapped"], timed["wrapped_optimizer"] = time_wrapped_blocks(
            cfg, meshes, ROWS, median_s, sync, device
        )
    return timed


def _keep_faster(level: dict[str, Any], again: dict[str, Any]) -> None:
    """A level's block timings from its start and its end, the faster kept: each is a few
    hundred milliseconds of work, which a passing disturbance (Ray's processes starting, a
    burst elsewhere) can double, as it did one profile in seven (its 2-worker plain block)."""
    for key in ("compute", "wrapped"):
        for name, by_rows in again.get(key, {}).items():
            for rows, seconds in by_rows.items():
                level[key][name][rows] = min(level[key][name][rows], seconds)
    level["optimizer"] = min(level["optimizer"], again["optimizer"])
    for name, seconds in again.get("wrapped_optimizer", {}).items():
        level["wrapped_optimizer"][name] = min(level["wrapped_optimizer"][name], seconds)


def _barrier(group) -> Callable[[], None] | None:
    """A barrier of `group` (None: nothing to wait for)."""
    if group is None:
        return None
    import torch.distributed as dist

    return lambda: dist.barrier(group=group)


def _wait_for_level(rank: int, k: int, distributed: bool) -> None:
    """Every rank waits until the `k` measuring ranks are done, polling the rendezvous store
    with sleeps (a collective barrier would keep the idle ranks spinning on the cores)."""
    if not distributed:
        return
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank < k:
        store.set(f"raylane-profile-{k}-{rank}", "done")
    keys = [f"raylane-profile-{k}-{r}" for r in range(k)]
    while not store.check(keys):
        time.sleep(0.02)


def summarise(records: list[dict], cfg, device="cpu") -> dict[str, Any]:
    """One profile from every worker's records: medians over workers, then the fits; the
    activations autograd saves measured on `device`."""
    import torch

    m = cfg.model
    levels = {
        str(k): _summarise_level([r["levels"][k] for r in records if k in r["levels"]])
        for k in records[0]["levels"]
    }  # JSON keys

    block, ends = (part.to(device) for part in _parts(cfg))
    block_activation = _saved_bytes_per_row(
        block,
        lambda rows: _hidden(cfg, rows, device),
    )
    ends_activation = _saved_bytes_per_row(  # what the loss keeps counts: a run computes it
        lambda tokens: cross_entropy(ends(tokens), tokens),
        lambda rows: torch.randint(0, m.num_classes, (rows, m.input_dim), device=device),
    )
    # At the largest concurrency measured (the job's worker group): the headline figures.
    top = levels[str(max(records[0]["levels"]))]
    largest = max(ROWS)
    block_s = top["block"]["fixed_s"] + top["block"]["per_row_s"] * largest
    return {
        "workers": len(records),
        "levels": levels,
        "block_params": sum(p.numel() for p in block.parameters()),
        "ends_params": sum(p.numel() for p in ends.parameters()),
        "block_activation_bytes_per_row": block_activation,
        "ends_activation_bytes_per_row": ends_activation,
        "baseline_rss_mb": statistics.median(r["baseline_rss_mb"] for r in records),
        **_device_baseline(records),
        "block_flops_per_s": block_train_flops(largest, shape_of(m)) / block_s,
        "all_reduce": top.get("all_reduce"),
        "p2p": asdict(link_fit(_median_by_size(records, "p2p"))) if "p2p" in records[0] else None,
    }


def _device_baseline(records: list[dict]) -> dict[str, float]:
    """A GPU profile's device memory before any model (`baseline_device_mb`), else nothing."""
    if "baseline_device_mb" not in records[0]:
        return {}
    return {"baseline_device_mb": statistics.median(r["baseline_device_mb"] for r in records)}


def _summarise_level(measured: list[dict]) -> dict[str, Any]:
    """One level's figures from the records of the workers that measured it."""
    level: dict[str, Any] = {}
    for part in ("block", "block_forward", "ends"):
        by_rows = {
            rows: statistics.median(x["compute"][part][rows] for x in measured) for rows in ROWS
        }
        level[part] = asdict(compute_fit(by_rows))
        level[f"{part}_s"] = {str(rows): seconds for rows, seconds in by_rows.items()}
    level["optimizer_s_per_param"] = statistics.median(x["optimizer"] for x in measured)
    if "ps_push" in measured[0]:
        level["ps_push_s"] = statistics.median(x["ps_push"] for x in measured)
    if "all_reduce" in measured[0]:
        level["all_reduce"] = asdict(link_fit(_median_by_size(measured, "all_reduce")))
        level["ddp_wait"] = asdict(compute_fit(_median_by_size(measured, "ddp")))
    if "wrapped" in measured[0]:
        level["wrapped"] = {
            name: {
                **asdict(compute_fit(_median_by_rows(measured, "wrapped", name))),
                "optimizer_s": statistics.median(x["wrapped_optimizer"][name] for x in measured),
            }
            for name in measured[0]["wrapped"]
        }
    if "schedules" in measured[0]:
        level["schedules"] = {
            name: asdict(compute_fit(by_micro))
            for name, by_micro in measured[0]["schedules"].items()
        }
    return level


def _median_by_rows(measured: list[dict], key: str, name: str) -> dict[int, float]:
    return {rows: statistics.median(x[key][name][rows] for x in measured) for rows in ROWS}


def _median_by_size(records: list[dict], key: str) -> dict[int, float]:
    return {size: statistics.median(r[key][size] for r in records) for size in records[0][key]}
