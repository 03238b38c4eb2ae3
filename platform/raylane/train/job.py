"""A training job as the driver runs it: data check, MLflow run, Ray Train fit, registry.

The steps around the fit live beside it: `raylane.train.preflight` (what is checked before
Ray starts), `raylane.train.run_context` (the MLflow run's name, base and tags) and
`raylane.train.model_record` (the model logged and registered)."""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlflow
import ray
from mlflow.tracking import MlflowClient

from raylane.config import RaylaneConfig
from raylane.data import dataset_digest
from raylane.data.ray_datasets import read_datasets
from raylane.parallel.precision import bf16_speed
from raylane.runtime import connect_ray
from raylane.tracking import TrackingError
from raylane.tracking.identity import code_digest, package_dir
from raylane.tracking.runs import OUTAGE, TrackingOutageError, fail_fast_tracking
from raylane.train.elastic import NodeWatch
from raylane.train.errors import CODE_MISMATCH, CodeMismatchError
from raylane.train.model_record import record_model, warm_model_logging
from raylane.train.phases import MARK_PREFIX, PhaseClock, marks_from_metrics
from raylane.train.preflight import preflight
from raylane.train.recorder import RunRecorder
from raylane.train.run_context import (
    RunContext,
    keep_run_worker_logs,
    resolve_run_base,
    run_start,
)
from raylane.train.trainer import build_trainer, journal_path
from raylane.train.worker_spec import DriverLink

__all__ = [
    "CodeMismatchError",
    "TrainingOutcome",
    "build_trainer",
    "preflight",
    "record_phases",
    "run_training",
]

log = logging.getLogger("raylane")


@dataclass(frozen=True)
class TrainingOutcome:
    run_id: str
    experiment_id: str
    tracking_uri: str
    metrics: dict
    checkpoint_path: str
    model_uri: str | None  # None when not registered
    model_version: int | None
    promoted: bool
    promotion: str


def run_training(
    cfg: RaylaneConfig,
    *,
    register: bool = True,
    tags: dict[str, str] | None = None,
    resume_run_id: str | None = None,
    phases: PhaseClock | None = None,
    base=None,
) -> TrainingOutcome:
    """Run one training job end to end and return where its results are.

    `register=False` (a reproduction) keeps the weights digest but logs no model and leaves
    the registry alone; `tags` are set on the new run. `resume_run_id` continues that MLflow
    run (its driver killed, say): Ray Train finds its state under the same name and storage.

    What can fail cheaply (data, store, a fine-tuning `base` unless given) is checked before
    Ray starts. `phases` collects where the time went, recorded as `phase_*_s` metrics.
    """
    phases = phases or PhaseClock()
    with phases.phase("preflight"):
        tracking_uri, predicted = preflight(cfg)
        digest = dataset_digest(cfg.data.train_path, cfg.data.validation_path)
        base = base or resolve_run_base(cfg, tracking_uri, resume_run_id)
    with phases.phase("ray"):
        connect_ray(ship=cfg.model.factory_source())
    setup_start = time.time()
    mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.set_experiment(cfg.experiment)
    run_name, start = run_start(cfg, resume_run_id)
    context = RunContext(cfg, tags, resume_run_id, digest, base, tracking_uri)
    with mlflow.start_run(**start) as run:
        log.info("MLflow run %s in %s", run.info.run_id, tracking_uri)
        if predicted is not None:  # beside the measured `peak_rss_mb` of each epoch
            mlflow.log_metric("predicted_peak_mb", predicted.total / 2**20, step=0)
        try:
            result, metrics, registered = _fit_and_record(
                cfg, run_name, run.info.run_id, context, phases, setup_start, register
            )
        except TrackingError:
            _end_unreachable_run()
            raise
    model_uri, version, promoted, promotion = registered or (None, None, False, "not registered")
    return TrainingOutcome(
        run_id=run.info.run_id,
        experiment_id=experiment.experiment_id,
        tracking_uri=tracking_uri,
        metrics=metrics,
        checkpoint_path=result.checkpoint.path,
        model_uri=model_uri,
        model_version=version,
        promoted=promoted,
        promotion=promotion,
    )


def _end_unreachable_run() -> None:
    """End the job's MLflow run after a tracking outage stopped it, trying the server once
    (MLflow's retries would hold the one-line stop for minutes): while it is still away the
    run stays RUNNING, and `raylane train --resume` continues it."""
    with fail_fast_tracking(), contextlib.suppress(Exception):
        mlflow.end_run("FAILED")


def _fit_and_record(
    cfg: RaylaneConfig,
    run_name: str,
    run_id: str,
    context: RunContext,
    phases: PhaseClock,
    setup_start: float,
    register: bool,
):
    """The job inside its MLflow run: fit while the run's context is recorded on a thread;
    then send what an outage held back, keep the workers' output, draw the step split figure
    and record the model (logged and registered unless `register` is off). `setup_start` is
    when the run's setup began. (result, numeric final metrics, what `record_model`
    returned)."""
    uri, resumed = context.tracking_uri, context.resume_run_id is not None
    with ThreadPoolExecutor(2, "raylane-run") as background:
        recorder = _recorder(cfg, run_name, uri, run_id, resumed)
        trainer = _job_trainer(cfg, run_name, uri, run_id, recorder, context.base)
        # The run's context (params, config, cluster snapshot, inputs) is recorded while Ray
        # starts the worker group: nothing in the fit reads it.
        recording = background.submit(context.record, run_id)
        fit_start = time.time()
        phases.add("run_setup", fit_start - setup_start)
        try:
            result, metrics = _fit_run(cfg, trainer, recorder, register)
        except TrackingError:
            raise  # the server is away: nothing more is sent to it (MLflow would retry)
        except BaseException:
            # Each rank's console output, read from Ray's log files: how the fit failed.
            background.submit(keep_run_worker_logs, uri, run_id, recorder.placement)
            raise
        context.recorded(recording, run_id)
        fit_end = time.time()
        if result.checkpoint is None:
            raise RuntimeError(f"run {run_name} ended without a checkpoint")
        phases.split_fit(fit_start, fit_end, marks_from_metrics(result.metrics))
        # Metrics an outage held back, if any: the server is back, or the run stops here
        # (before the model and the logs wait on it with MLflow's retries).
        _outage_stops(recorder.close)
        logs = background.submit(keep_run_worker_logs, uri, run_id, recorder.placement)
        drawn = background.submit(recorder.draw)  # the last epochs' step split figure
        registered = record_model(cfg, result.checkpoint, metrics, register)
        logs.result()
        drawn.result()
        phases.add("model", time.time() - fit_end)
        mlflow.log_metrics(phases.metrics())
    return result, metrics, registered


def record_phases(outcome: TrainingOutcome, phases: PhaseClock) -> None:
    """The phases measured after the run closed (Ray's shutdown) and the job's total, added
    to the run's `phase_*_s` metrics."""
    client = MlflowClient(tracking_uri=outcome.tracking_uri)
    late = {
        "phase_shutdown_s": phases.seconds.get("shutdown", 0.0),
        "phase_total_s": phases.total(),
    }
    for name, value in late.items():
        client.log_metric(outcome.run_id, name, value)


def _job_trainer(cfg: RaylaneConfig, run_name, tracking_uri, run_id, recorder, base=None):
    """The job's TorchTrainer: its datasets, the journal rank 0 keeps for the `recorder`, the
    MLflow run that ranks on other nodes sample their system metrics into, the driver's code
    identity (workers running other code are refused) and a fine-tuning run's base weights
    (in the object store: workers never read the registry)."""
    link = DriverLink(
        tracking_uri=tracking_uri,
        run_id=run_id,
        journal_path=str(recorder.journal),  # rank 0 writes what the recorder reads
        # The driver samples its own node's system metrics; ranks sample the other nodes.
        driver_node=recorder.driver_node,
        driver_code={"code_digest": code_digest(), "code_path": str(package_dir())},
        base_state=ray.put(base.state) if base is not None and base.state is not None else None,
    )
    trainer = build_trainer(cfg, read_datasets(cfg), run_name, link)
    epochs = cfg.training.epochs
    log.info(
        "training: %s, %s, %d epoch%s",
        cfg.parallelism.strategy,
        cfg.parallelism.dims.describe(),
        epochs,
        "" if epochs == 1 else "s",
    )
    if cfg.training.precision == "bf16":  # as the driver sees it (other nodes may differ)
        log.info(bf16_speed(cfg.parallelism.use_gpu)[1])
    if cfg.finetune is not None:
        frozen = cfg.frozen_base_dtype()
        recompute = "recomputed" if cfg.training.activation_checkpointing else "held"
        lora = f"LoRA rank {cfg.finetune.rank}: the frozen base in {frozen}, the adapters in fp32"
        what = lora if frozen else "every weight trained"
        log.info("%s, activations %s, host memory %s", what, recompute, cfg.training.host_memory)
    return trainer


def _recorder(cfg: RaylaneConfig, run_name: str, tracking_uri: str, run_id: str, resumed: bool):
    """The run's recorder: rank 0's journal into the MLflow run, epoch lines on the console."""
    return RunRecorder(
        journal_path(cfg, run_name),
        tracking_uri,
        run_id,
        cfg.training.epochs,
        cfg.tracking.outage_window_s,
        cfg.tracking.system_metrics_interval_s,
        driver_node=ray.get_runtime_context().get_node_id(),
        resumed=resumed,
    )


def _fit_run(cfg: RaylaneConfig, trainer, recorder, register: bool):
    """Fit with the epoch lines on the console and the journal logged as it grows; the result
    and its numeric final metrics. A tracking outage past its window stops the fit."""
    warming = warm_model_logging() if register else None
    watch = NodeWatch() if cfg.parallelism.elastic else contextlib.nullcontext()
    with fail_fast_tracking(), recorder, watch:
        try:
            result = _fit(trainer)
        except BaseException:
            if recorder.error is None:
                raise
            result = None
    if recorder.error is not None:  # the recorder stopped the fit: the outage is the error
        raise TrackingError(str(recorder.error)) from None
    if warming is not None:
        warming.join()
    metrics = {
        k: v
        for k, v in result.metrics.items()
        if isinstance(v, int | float) and not k.startswith(MARK_PREFIX)
    }
    return result, metrics


def _fit(trainer):
    """`trainer.fit()`, with the workers' own one-line failures (mixed code, a tracking outage
    past its window) raised as such instead of Ray's traceback."""
    try:
        return trainer.fit()
    except Exception as exc:
        for marker, error in ((CODE_MISMATCH, CodeMismatchError), (OUTAGE, TrackingError)):
            line = next((x for x in str(exc).splitlines() if marker in x), None)
            if line is not None:
                raise error(line[line.index(marker) :]) from None
        raise


def _outage_stops(call) -> None:
    """`call()` failing fast on each try, with a tracking outage past its window raised as
    the job's one-line error."""
    try:
        with fail_fast_tracking():
            call()
    except TrackingOutageError as outage:
        raise TrackingError(str(outage)) from None
