"""`train_loop_per_worker`: what each Ray Train worker runs.

Strategy-agnostic: the parallelism strategy wraps the model and runs each step; this loop feeds
batches, evaluates, checkpoints, and reports once per epoch. The training loss is cross-entropy
over the last dimension of the outputs, which covers classification (`[B, C]` vs `[B]`) and
language modelling (`[B, T, V]` vs `[B, T]`), or a custom model's own `loss_fn`; validation
is cross-entropy for every model.
"""

from __future__ import annotations

import math
import os
import random
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
import torch.distributed as dist

from raylane.config import RaylaneConfig
from raylane.config.families import traits
from raylane.data.memory import MemorySplit, memory_batches
from raylane.data.parquet import use_system_allocator
from raylane.models.adapters import adapt
from raylane.models.classifier import build_model_and_loss
from raylane.models.optim import build_optimizer
from raylane.parallel import get_strategy
from raylane.parallel.device import all_reduce_scalars, synchronize
from raylane.parallel.meters import ActivationMeter, worker_memory
from raylane.parallel.precision import apply_matmul_precision
from raylane.runtime import apply_host_memory, worker_threads
from raylane.tracking.identity import code_digest, package_dir, requirements
from raylane.tracking.step_times import StepTimes, step_metrics
from raylane.tracking.system_metrics import node_label, start_node_monitor
from raylane.train.batches import iter_torch_batches
from raylane.train.checkpointing import Position, restore
from raylane.train.elastic import at_world_size
from raylane.train.errors import CODE_MISMATCH
from raylane.train.journal import Journal
from raylane.train.phases import WorkerMarks
from raylane.train.progress import ProgressTicker
from raylane.train.step_checkpoints import StepCheckpoints, epoch_start, restore_point
from raylane.train.straggler import Straggler
from raylane.train.worker_spec import WorkerSpec


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


MAX = dist.ReduceOp.MAX


def peak_rss_mb() -> float:
    """The largest resident set of any worker so far (MB): what a CPU run's memory budget is
    held to."""
    (peak,) = all_reduce_scalars([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], MAX)
    return peak


def _my_batches(strategy, shard, cfg: RaylaneConfig, shuffle_seed: int | None, whole=False):
    """This worker's batches. Workers that read every row (pipeline stages, tensor-parallel
    and FSDP workers) read global batches of `data_world` x batch_size rows and take their
    replica's slice, so a layout with dp replicas trains on exactly the batches one worker
    with dp times the batch size would.

    `shard` is a Ray Data shard or a `MemorySplit`. Data-parallel workers of the memory feed
    each take their part of global batches drawn in one order (the same seed everywhere);
    Ray Data shards are disjoint already and each shuffles with its rank in the seed."""
    rows = cfg.training.batch_size
    first = strategy.data_rank * rows
    # Training: every replica takes a full slice of each global batch (pipeline stages infer
    # their buffers' shapes once), and the last, partial one is dropped. `whole` (evaluation)
    # keeps it, each worker its slice, maybe short or empty, so every row counts once as with
    # one worker; only a pipeline's evaluation drops it (outside an elastic run), which the
    # preflight refuses where that leaves no batch (`raylane.train.preflight`).
    ragged = strategy.evaluates_ragged or cfg.parallelism.elastic
    drop_last = not strategy.splits_dataset and not (whole and ragged)
    if isinstance(shard, MemorySplit):
        splits = strategy.splits_dataset
        part, parts = (dist.get_rank(), dist.get_world_size()) if splits else (0, 1)
        batches = memory_batches(
            *shard.arrays(),
            batch_size=rows * strategy.data_world,
            part=part,
            parts=parts,
            shuffle_seed=shuffle_seed,
            drop_last=drop_last,
        )
    else:
        if shuffle_seed is not None and strategy.splits_dataset:
            shuffle_seed += dist.get_rank()
        batches = iter_torch_batches(
            shard,
            batch_size=rows * strategy.data_world,
            features_column=cfg.data.features_column,
            label_column=cfg.data.label_column,
            shuffle_seed=shuffle_seed,
            drop_last=drop_last,
        )
    for inputs, targets in batches:
        yield strategy.local_batch(inputs[first : first + rows], targets[first : first + rows])


def _train_epoch(
    strategy, model, loss_fn, optimizer, shard, cfg, epoch, rank, marks, start, saver, ticker
):
    """One epoch of training on `loss_fn`: mean loss, rows the group trained on in this run, the
    group's step-time split (`raylane.tracking.step_times`) and this worker's epoch time.
    `start`: where a step checkpoint left it (`step_checkpoints.epoch_start`); `saver` writes
    the step checkpoints; `ticker` journals the epoch's progress (silent but on rank 0)."""
    model.train()
    skip, loss_sum, rows = start
    carried = rows  # rows a step checkpoint counted before this run (rank 0 holds them)
    times = StepTimes()
    straggler = Straggler(cfg.parallelism.straggler, rank)
    # Workers that read the same rows (pipeline stages) must shuffle them the same way.
    seed = cfg.training.seed * 100_003 + epoch * 1_009
    batches = _my_batches(strategy, shard, cfg, seed)
    # Activation bytes autograd holds: the strategy's own meter (pipeline stages), else one
    # around each step.
    activations = strategy.activations
    own_meter = activations is None
    if own_meter:
        activations = ActivationMeter()
    activations.reset()
    marks.mark("data_start")
    ticker.start(epoch, _steps_in_epoch(strategy, shard, cfg))
    start = step_start = time.perf_counter()
    for step, (inputs, targets) in enumerate(batches):
        marks.mark("first_batch")
        if cfg.training.steps_per_epoch is not None and step >= cfg.training.steps_per_epoch:
            break
        if step < skip:  # trained on before the step checkpoint this run continues from
            step_start = time.perf_counter()
            continue
        if saver.between_steps(epoch, step, skip, loss_sum, rows):  # a checkpoint written
            step_start = time.perf_counter()  # the checkpoint's time is not this step's
        data_wait = time.perf_counter() - step_start
        straggler.maybe_wait(epoch, step)
        if own_meter:
            with activations:
                loss = strategy.train_step(model, optimizer, loss_fn, inputs, targets)
        else:
            loss = strategy.train_step(model, optimizer, loss_fn, inputs, targets)
        if strategy.reports_loss:  # each of a row's `row_reporters` workers counts its share
            share = len(targets) / strategy.row_reporters
            # Summed on the loss's device in float64 (as a host float would): no host sync.
            loss_sum = loss_sum + loss.double() * share
            rows += share
        now = time.perf_counter()
        parts = dict(strategy.last_step_parts)
        if straggler.waited_s:
            parts["straggler"] = straggler.waited_s
        times.add(now - step_start, data_wait, parts)
        ticker.step_done(step, data_wait)
        saver.step_done()
        marks.mark("first_step")
        step_start = now
    synchronize(strategy.device)  # the epoch's time includes its queued GPU work
    elapsed = time.perf_counter() - start
    strategy.steps_done()  # before the collectives of the totals
    totals = _epoch_totals(strategy, model, optimizer, activations, loss_sum, rows, carried, times)
    return *totals, elapsed


def _steps_in_epoch(strategy, shard, cfg: RaylaneConfig) -> int | None:
    """Optimizer steps in an epoch where that is known ahead: `training.steps_per_epoch`, or
    the memory feed's rows over the global batch (a Ray Data shard's rows are not counted)."""
    steps = cfg.training.steps_per_epoch
    if isinstance(shard, MemorySplit):
        rows = cfg.training.batch_size * strategy.data_world
        whole = shard.rows // rows if not strategy.splits_dataset else -(-shard.rows // rows)
        steps = whole if steps is None else min(steps, whole)
    return steps


def _epoch_totals(strategy, model, optimizer, activations, loss_sum, rows, carried, times):
    """Collective: the group's mean loss over the epoch, the rows this run trained on (not
    those a step checkpoint carried over), the step-time split of an epoch and the largest
    worker's memory (on GPUs also its device peak: `worker_device_peak_mb`)."""
    memory = worker_memory(model, optimizer, activations, strategy.device)
    totals = all_reduce_scalars([loss_sum, rows, carried, *times.as_list()])
    total_loss, total_rows, carried_rows, *step_totals = totals
    # The largest worker's model state and activations (MB): what must fit on one device.
    largest = all_reduce_scalars(list(memory.values()), MAX)
    # Data-parallel replicas each count their own rows; pipeline stages of one replica count
    # them once (only the last stage reports).
    split = step_metrics(step_totals)
    split.update(
        {f"worker_{name}_mb": value / 2**20 for name, value in zip(memory, largest, strict=True)}
    )
    return total_loss / max(total_rows, 1), round(total_rows - carried_rows), split


@torch.no_grad()
def _evaluate(strategy, model, shard, cfg):
    """Mean loss and accuracy over the validation targets that count (not -100: a prompt's
    tokens in chat data): the sums kept on the outputs' device (float64, as host floats would)
    and read back once, by the group's reduction."""
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for inputs, targets in _my_batches(strategy, shard, cfg, shuffle_seed=None, whole=True):
        sums = strategy.validation_sums(model, inputs, targets)  # every rank takes part
        if sums is None or not targets.numel():
            continue
        batch_loss, batch_correct, batch_count = sums
        loss_sum, correct = loss_sum + batch_loss, correct + batch_correct
        count = count + batch_count
    loss_sum, correct, count = all_reduce_scalars([loss_sum, correct, count])
    if count == 0:  # a mean of nothing is no figure: never log it as 0 (it would win champion)
        raise ValueError(
            "validation: no target was evaluated (the validation split is empty, or every "
            "label is -100); raise data.validation_fraction"
        )
    return loss_sum / count, correct / count


def check_same_code(placement: list[dict], driver: dict | None = None) -> None:
    """Stop the run when workers imported different raylane sources than each other or than
    the driver (a node built from an older image, a job whose workers import the cluster's
    installed copy instead of the submitted one): its results would belong to no one version."""
    seen = {(r["node"], r["code_digest"], r["code_path"]) for r in placement}
    if driver is not None:
        seen.add(("driver", driver["code_digest"], driver["code_path"]))
    if len({digest for _, digest, _ in seen}) > 1:
        found = "; ".join(f"{who}: {digest[:12]} at {path}" for who, digest, path in sorted(seen))
        raise RuntimeError(f"{CODE_MISMATCH}: {found}")


def _gather_placement(rank: int) -> list[dict]:
    """Every rank's Ray node id, system-metrics node label, host, pid, thread count,
    determinism settings and code identity (collective: every rank calls)."""
    import socket

    mine = {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "node": node_label(),
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "code_digest": code_digest(),
        "code_path": str(package_dir()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    return gathered


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Train the configured model on this worker's data, reporting once per epoch.

    `loop_config` is Ray Train's dict around the driver's `WorkerSpec`: the resolved config,
    and the MLflow run to log into (`tracking_uri`, `run_id`, `journal_path`): rank 0 journals
    where every rank ran and each epoch, which the driver logs into the run (it keeps each
    rank's console output too); the first rank on each node other than the driver's samples
    its system metrics.
    """
    marks = WorkerMarks()  # rank 0's marks split the job's phases (raylane.train.phases)
    context = ray.train.get_context()
    spec = WorkerSpec.from_loop_config(loop_config)
    cfg = spec.raylane_config()
    cfg = at_world_size(cfg, context.get_world_size())  # an elastic group's share of the batch
    rank = context.get_world_rank()
    torch.set_num_threads(worker_threads(cfg, context.get_local_world_size()))
    use_system_allocator()  # Ray Data's batches: Arrow's freed pages go back to the system
    apply_host_memory(cfg.training.host_memory)
    apply_matmul_precision(cfg.training.precision)
    seed_everything(cfg.training.seed)

    strategy = get_strategy(cfg, rank)
    plain, loss_fn = _plain_model(cfg, spec)
    model = strategy.wrap_model(plain)  # raylane.parallel.parallelize
    training = cfg.training
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = build_optimizer(trainable, training.optimizer, training.lr, training.weight_decay)

    start = _restore(strategy, model, optimizer, restore_point(cfg, spec), cfg)
    placement = _gather_placement(rank)
    check_same_code(placement, spec.driver_code)
    journal, monitor = _start_tracking(spec, cfg, rank, placement)
    try:
        _train_epochs(strategy, model, loss_fn, optimizer, cfg, start, rank, journal, marks, spec)
    finally:
        if monitor is not None:
            monitor.finish()


def _plain_model(cfg: RaylaneConfig, spec: WorkerSpec):
    """The model before any parallelism, and the loss it trains with (`build_model_and_loss`):
    freshly initialised, or a fine-tuning run's base (its weights from the object store, or an
    imported checkpoint's from `model.pretrained`) with `finetune:`'s adapters."""
    frozen = cfg.frozen_base_dtype()
    stored_bf16 = frozen == "bf16" and cfg.model.stored_dtype() == "bfloat16"
    # A bf16 checkpoint is read straight in bf16; any other is read as stored and cast.
    model, loss_fn = build_model_and_loss(
        cfg.model, torch.bfloat16 if stored_bf16 else torch.float32
    )
    if cfg.finetune is not None:
        if spec.base_state is not None:
            model.load_state_dict(ray.get(spec.base_state))
        adapt(model, cfg.finetune, frozen)
    return model, loss_fn


def _restore(strategy, model, optimizer, checkpoint, cfg: RaylaneConfig) -> Position:
    """Where to start: after a worker-group failure, the run's last `checkpoint`
    (`step_checkpoints.restore_point`); otherwise the run may start from an earlier run's
    (`resume_from`)."""
    if checkpoint is None and cfg.training.resume_from is not None:
        checkpoint = ray.train.Checkpoint(str(cfg.training.resume_from))
    if checkpoint is None:
        return Position(0)
    with checkpoint.as_directory() as directory:
        plain, part = strategy.unwrap_model(model), strategy.checkpoint_part
        return restore(Path(directory), model, optimizer, plain, part, strategy.steps_optimizer)


def _start_tracking(spec: WorkerSpec, cfg: RaylaneConfig, rank: int, placement):
    """Rank 0's journal (`raylane.train.journal`: the driver logs it into the MLflow run),
    opened with the group's placement and the workers' packages, and this node's system
    metrics monitor when this is its first rank and the driver does not sample the node
    itself; (None, None) for a run without MLflow (a Tune trial)."""
    if not spec.journal_path:
        return None, None
    journal = None
    if rank == 0:
        journal = Journal(spec.journal_path)
        journal.log_group(placement, requirements())
    # The first rank on each Ray node samples it (not "local rank 0": Ray numbers local ranks
    # per IP, and several nodes can share one); the driver samples its own node.
    node = ray.get_runtime_context().get_node_id()
    first_here = min(r["rank"] for r in placement if r["node_id"] == node) == rank
    first_here = first_here and node != spec.driver_node
    uri, run_id = spec.tracking_uri, spec.run_id
    interval_s = cfg.tracking.system_metrics_interval_s
    return journal, start_node_monitor(uri, run_id, interval_s, first_here)


def _log_base_loss(strategy, model, validation_shard, cfg, journal) -> None:
    """A fine-tuning run's base on the new domain, before the first step (`base_val_loss`)."""
    base_loss, _ = _evaluate(strategy, model, validation_shard, cfg)
    if journal is not None:
        journal.log({"base_val_loss": base_loss}, step=0)


def _train_epochs(
    strategy, model, loss_fn, optimizer, cfg, start, rank, journal, marks, spec: WorkerSpec
):
    """From `start` on: train (on `loss_fn`), evaluate, journal (rank 0), checkpoint and report
    each epoch."""
    memory = spec.memory_splits
    train_shard = memory.get("train") or ray.train.get_dataset_shard("train")
    validation_shard = memory.get("validation") or ray.train.get_dataset_shard("validation")
    if cfg.finetune is not None and start == Position(0):
        _log_base_loss(strategy, model, validation_shard, cfg, journal)
    saver = StepCheckpoints(cfg, strategy, model, optimizer, start, spec, journal)
    every_s = cfg.training.progress_every_s if journal is not None else 0.0  # rank 0 says it
    emit = journal.log_progress if journal is not None else None
    ticker = ProgressTicker(every_s, emit, cfg.training.batch_size * strategy.data_world)
    for epoch in range(start.epoch, cfg.training.epochs):
        train_loss, rows, split, elapsed = _train_epoch(
            strategy, model, loss_fn, optimizer, train_shard, cfg, epoch, rank, marks,
            epoch_start(start, epoch), saver, ticker,
        )  # fmt: skip
        stats = strategy.epoch_stats()
        val_loss, val_accuracy = _evaluate(strategy, model, validation_shard, cfg)
        metrics = {
            "epoch": epoch,
            **saver.epoch_metrics(),
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_accuracy": val_accuracy,
            "train_samples_per_s": rows / elapsed if elapsed > 0 else 0.0,
            "epoch_time_s": elapsed,
            "peak_rss_mb": peak_rss_mb(),
            **split,
            **stats,
        }
        if traits(cfg.model.kind).language and cfg.data.tokenizer == "bytes":
            metrics["val_bits_per_byte"] = val_loss / math.log(2)  # one token is one byte
        again = epoch == start.epoch  # an earlier group may have ended it before a restart
        if journal is not None:  # before the report: the driver has it when fit() returns
            journal.log_epoch(metrics, epoch, again, strategy.run_tables)
        saver.report(epoch, metrics, f"epoch_{epoch:04d}", marks.report_metrics())
