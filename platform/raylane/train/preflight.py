"""What a training job checks on the driver before compute is spent: the resume checkpoint,
a custom model's factory, the tracking store and the dataset. Import-light (no torch, no Ray),
so the command line runs these checks before either is imported (a custom model's check
imports torch)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil

from raylane.config import ConfigError, RaylaneConfig
from raylane.config.families import traits
from raylane.data import DataError, ensure_dataset
from raylane.models.worker_memory import WorkerPeak, predicted_peak
from raylane.tracking import check_tracking_reachable, resolve_tracking_uri
from raylane.train.checkpoint_files import META_FILE

log = logging.getLogger("raylane")


def check_run_inputs(cfg: RaylaneConfig) -> str:
    """The resume checkpoint, a custom model (built once on the meta device:
    `raylane.models.custom.check_custom_model`) and the tracking store; returns the store's
    URI."""
    if cfg.training.resume_from is not None:
        check_resumable(cfg.training.resume_from)
    if traits(cfg.model.kind).factory:
        # lazy: torch, which only a custom model's check needs before Ray starts
        from raylane.models.custom import check_custom_model

        check_custom_model(cfg)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    check_tracking_reachable(tracking_uri)
    return tracking_uri


def preflight(cfg: RaylaneConfig) -> tuple[str, WorkerPeak | None]:
    """Everything that can fail before compute is spent: the run inputs above, then the
    dataset (prepared if built in). Returns the tracking URI, and each worker's predicted peak
    memory where the family's shape predicts it (`raylane.models.worker_memory`), said here."""
    tracking_uri = check_run_inputs(cfg)
    train_info, val_info = ensure_dataset(cfg)
    log.info("data: %d training rows, %d validation rows", train_info.rows, val_info.rows)
    check_whole_batches(cfg, train_info.rows, val_info.rows)
    peak = predicted_peak(cfg, val_info.rows)
    if peak is not None:
        log.info("predicted peak memory per worker: %s", peak.describe())
        if not os.environ.get("RAY_ADDRESS"):  # a local Ray: every worker on this machine
            check_fits_here(cfg, peak, psutil.virtual_memory().available)
    return tracking_uri, peak


def check_fits_here(cfg: RaylaneConfig, peak: WorkerPeak, available: float) -> None:
    """Refuse, before Ray starts, a local run whose workers' predicted peaks add up to more
    than this machine's `available` bytes: one line with the figures and what lowers them."""
    workers = cfg.parallelism.workers
    need = peak.total * workers
    if need <= available:
        return
    levers = ["a smaller training.batch_size"]
    if not cfg.training.activation_checkpointing:
        levers.insert(0, "training.activation_checkpointing: true")
    if cfg.training.host_memory != "lean":
        levers.append("training.host_memory: lean")
    raise ConfigError(
        f"the run would need about {need / 2**30:.1f} GB ({workers} workers x "
        f"{peak.describe()}), more than the {available / 2**30:.1f} GB this machine has "
        f"available: try {', '.join(levers)}, or a cluster (RAY_ADDRESS)"
    )


def check_whole_batches(cfg: RaylaneConfig, train_rows: int, val_rows: int) -> None:
    """A layout that splits the model (FSDP, tensor, pipeline or context parallel) trains on
    whole global batches of batch_size rows per replica, and a pipeline evaluates on them too:
    a split with fewer rows would give no step (or no validation figure) at all. Refused in
    one line, before Ray starts."""
    dims = cfg.parallelism.dims
    if not (dims.fsdp_enabled or dims.tp_enabled or dims.pp_enabled or dims.cp_enabled):
        return
    rows, replicas = cfg.training.batch_size, dims.dp
    batch = rows * replicas
    splits = [("training", cfg.data.train_path, train_rows)]
    if dims.pp_enabled and not cfg.parallelism.elastic:
        splits.append(("validation", cfg.data.validation_path, val_rows))
    for name, path, count in splits:
        if count < batch:
            raise DataError(
                f"{path}: {count} {name} rows, fewer than one global batch of {batch} "
                f"(training.batch_size {rows} x {replicas} data-parallel replicas), which a "
                f"{dims.preset_name} layout {'trains' if name == 'training' else 'evaluates'} "
                "on whole: lower training.batch_size"
            )


def check_resumable(directory: Path) -> None:
    """Refuse, before Ray starts, a resume path that holds no checkpoint."""
    if not (Path(directory) / META_FILE).is_file():
        raise DataError(f"{directory}: training.resume_from is not a raylane checkpoint")
