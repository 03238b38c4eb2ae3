"""A training job as the driver runs it: data check, MLflow run, Ray Train fit, registry."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from raylane.config import RaylaneConfig
from raylane.console import long_step
from raylane.train.phases import MARK_PREFIX, PhaseClock, marks_from_metrics

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


class CodeMismatchError(RuntimeError):
    """Workers imported different raylane sources; the message names the nodes."""


def _fit(trainer):
    """`trainer.fit()`, with the workers' own one-line failures (mixed code, a tracking outage
    past its window) raised as such instead of Ray's traceback."""
    from raylane.tracking import TrackingError
    from raylane.tracking.runs import OUTAGE
    from raylane.train.loop import CODE_MISMATCH

    try:
        return trainer.fit()
    except Exception as exc:
        for marker, error in ((CODE_MISMATCH, CodeMismatchError), (OUTAGE, TrackingError)):
            line = next((x for x in str(exc).splitlines() if marker in x), None)
            if line is not None:
                raise error(line[line.index(marker) :]) from None
        raise


def new_run_name(experiment: str) -> str:
    return f"{experiment}-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def check_run_inputs(cfg: RaylaneConfig) -> str:
    """The resume checkpoint and the tracking store; returns the store's URI. Cheap and
    import-light, so the CLI runs it before Ray starts."""
    from raylane.tracking import check_tracking_reachable, resolve_tracking_uri

    if cfg.training.resume_from is not None:
        check_resumable(cfg.training.resume_from)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    check_tracking_reachable(tracking_uri)
    return tracking_uri


def preflight(cfg: RaylaneConfig) -> str:
    """Everything that can fail before compute is spent: the run inputs above, then the
    dataset (prepared if built in). Returns the tracking URI."""
    from raylane.data import ensure_dataset

    tracking_uri = check_run_inputs(cfg)
    train_info, val_info = ensure_dataset(cfg)
    log.info("data: %d training rows, %d validation rows", train_info.rows, val_info.rows)
    return tracking_uri


def record_phases(outcome: TrainingOutcome, phases: PhaseClock) -> None:
    """The phases measured after the run closed (Ray's shutdown) and the job's total, added
    to the run's `phase_*_s` metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=outcome.tracking_uri)
    late = {
        "phase_shutdown_s": phases.seconds.get("shutdown", 0.0),
        "phase_total_s": phases.total(),
    }
    for name, value in late.items():
        client.log_metric(outcome.run_id, name, value)


def check_resumable(directory: Path) -> None:
    """Refuse, before Ray starts, a resume path that holds no checkpoint."""
    from raylane.data import DataError
    from raylane.train.checkpointing import META_FILE

    if not (Path(directory) / META_FILE).is_file():
        raise DataError(f"{directory}: training.resume_from is not a raylane checkpoint")


def _warm_model_logging() -> threading.Thread:
    """Import what logging the model needs on a thread while the fit runs: torch.export traces
    through torch._dynamo, whose first import costs about 2 s that the driver otherwise spends
    after training, while it mostly waits on the workers."""

    def _import() -> None:
        import mlflow.pytorch  # noqa: F401
        import torch._dynamo  # noqa: F401
        import torch.export  # noqa: F401

    thread = threading.Thread(target=_import, name="raylane-warm-export", daemon=True)
    thread.start()
    return thread


def _final_model(cfg: RaylaneConfig, checkpoint):
    from raylane.models import build_model
    from raylane.train.checkpointing import load_model_state

    model = build_model(cfg.model)
    if cfg.finetune is not None and cfg.finetune.method == "lora":
        from raylane.models.adapters import apply_lora

        apply_lora(model, cfg.finetune)  # the checkpoint holds base and adapter tensors
    with checkpoint.as_directory() as directory:
        model.load_state_dict(load_model_state(Path(directory)))
    return model.eval()


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
    import mlflow

    from raylane.data import dataset_digest
    from raylane.runtime import connect_ray

    phases = phases or PhaseClock()
    with phases.phase("preflight"):
        tracking_uri = preflight(cfg)
        digest = dataset_digest(cfg.data.train_path, cfg.data.validation_path)
        base = base or _resolve_base(cfg, tracking_uri, resume_run_id)
    with phases.phase("ray"):
        connect_ray()
    setup_start = time.time()
    mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.set_experiment(cfg.experiment)
    run_name, start = _run_start(cfg, resume_run_id)
    with mlflow.start_run(**start) as run, ThreadPoolExecutor(2, "raylane-run") as background:
        run_id = run.info.run_id
        log.info("MLflow run %s in %s", run_id, tracking_uri)
        recorder = _recorder(cfg, run_name, tracking_uri, run_id, resume_run_id is not None)
        trainer = _job_trainer(cfg, run_name, tracking_uri, run_id, recorder, base)
        # The run's context (params, config, cluster snapshot, inputs) is recorded while Ray
        # starts the worker group: nothing in the fit reads it.
        context = background.submit(
            _tag_run, cfg, tags, resume_run_id, digest, base, tracking_uri, run_id
        )
        fit_start = time.time()
        phases.add("run_setup", fit_start - setup_start)
        try:
            result, metrics = _fit_run(cfg, trainer, recorder, register)
        finally:
            # Each rank's console output, read from Ray's log files while the model is logged.
            logs = background.submit(_keep_worker_logs, tracking_uri, run_id, recorder.placement)
        _recorded(context, cfg, tags, resume_run_id, digest, base, tracking_uri, run_id)
        fit_end = time.time()
        if result.checkpoint is None:
            raise RuntimeError(f"run {run_name} ended without a checkpoint")
        phases.split_fit(fit_start, fit_end, marks_from_metrics(result.metrics))
        drawn = background.submit(recorder.draw)  # the last epochs' step split figure
        registered = _record_model(cfg, result.checkpoint, metrics, register)
        logs.result()
        drawn.result()
        _outage_stops(recorder.close)  # metrics an outage held back, if any
        phases.add("model", time.time() - fit_end)
        mlflow.log_metrics(phases.metrics())
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


def _run_start(cfg: RaylaneConfig, resume_run_id: str | None) -> tuple[str, dict[str, str]]:
    """The Ray Train run name and `mlflow.start_run` arguments: a new run, or the resumed one
    under its own name (so Ray Train finds its state)."""
    if resume_run_id:
        from mlflow.tracking import MlflowClient

        return MlflowClient().get_run(resume_run_id).info.run_name, {"run_id": resume_run_id}
    run_name = new_run_name(cfg.experiment)
    return run_name, {"run_name": run_name}


def _record_model(cfg: RaylaneConfig, checkpoint, metrics: dict, register: bool):
    """Tag the run with its last checkpoint and its weights' digest; log and register the
    assembled model unless `register` is off. `(uri, version, promoted, promotion)` or None."""
    import mlflow

    from raylane.tracking.identity import weights_digest

    mlflow.set_tag("raylane.checkpoint", checkpoint.path)
    final = _final_model(cfg, checkpoint)
    mlflow.set_tag("raylane.weights_digest", weights_digest(final.state_dict()))
    return _log_and_register(final, cfg, metrics) if register else None


def _resolve_base(cfg: RaylaneConfig, tracking_uri: str, resume_run_id: str | None = None):
    """A fine-tuning run's base (checked and loaded before Ray starts), else None; a resumed
    run's is the version and weights it recorded."""
    if cfg.finetune is None:
        return None
    from raylane.tracking.lineage import resolve_base

    expect = None
    if resume_run_id:
        from mlflow.tracking import MlflowClient

        from raylane.tracking.lineage import pinned_base

        tags = MlflowClient(tracking_uri).get_run(resume_run_id).data.tags
        cfg, expect = pinned_base(cfg, tags), tags.get("raylane.base_digest")
    with long_step(f"loading the base model {cfg.finetune.base}"):
        base = resolve_base(cfg, tracking_uri, expect)
    log.info("fine-tuning %s v%d (%s)", base.name, base.version, cfg.finetune.method)
    return base


def _tag_run(cfg: RaylaneConfig, tags, resume_run_id, digest: str, base, tracking_uri, run_id):
    """The caller's tags; a resumed run is marked, a new one gets its whole context (and a
    fine-tuning run its base)."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    from raylane.tracking.cluster import snapshot_cluster
    from raylane.tracking.runs import log_run_context

    client = MlflowClient(tracking_uri)
    if tags:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    if resume_run_id:
        client.set_tag(run_id, "raylane.resumed", "true")  # its base tags stay what it trained on
        return
    log_run_context(client, run_id, cfg, snapshot_cluster(cfg), digest)
    if base is not None:
        from raylane.tracking.lineage import log_base_input

        log_base_input(client, run_id, base)


def _keep_worker_logs(tracking_uri: str, run_id: str, placement: list[dict] | None) -> None:
    from mlflow.tracking import MlflowClient

    from raylane.tracking.worker_logs import keep_worker_logs

    if placement is None:  # the worker group never started
        return
    try:
        keep_worker_logs(MlflowClient(tracking_uri), run_id, placement)
    except Exception as exc:  # noqa: BLE001 - never mask how the fit ended
        log.warning("worker logs not kept: %s", exc)


def _job_trainer(cfg: RaylaneConfig, run_name, tracking_uri, run_id, recorder, base=None):
    """The job's TorchTrainer: its datasets, the journal rank 0 keeps for the `recorder`, the
    MLflow run that ranks on other nodes sample their system metrics into, the driver's code
    identity (workers running other code are refused) and a fine-tuning run's base weights
    (in the object store: workers never read the registry)."""
    import ray

    from raylane.data.ray_datasets import read_datasets
    from raylane.tracking.identity import code_digest, package_dir
    from raylane.train.trainer import build_trainer
    from raylane.train.worker_spec import DriverLink

    link = DriverLink(
        tracking_uri=tracking_uri,
        run_id=run_id,
        journal_path=str(recorder.journal),  # rank 0 writes what the recorder reads
        # The driver samples its own node's system metrics; ranks sample the other nodes.
        driver_node=recorder.driver_node,
        driver_code={"code_digest": code_digest(), "code_path": str(package_dir())},
        base_state=ray.put(base.state) if base is not None else None,
    )
    trainer = build_trainer(cfg, read_datasets(cfg), run_name, link)
    log.info(
        "training: %s, %s, %d epochs",
        cfg.parallelism.strategy,
        cfg.parallelism.dims.describe(),
        cfg.training.epochs,
    )
    if cfg.training.precision == "bf16":  # as the driver sees it (other nodes may differ)
        from raylane.parallel.precision import bf16_speed

        log.info(bf16_speed(cfg.parallelism.use_gpu)[1])
    return trainer


def _recorder(cfg: RaylaneConfig, run_name: str, tracking_uri: str, run_id: str, resumed: bool):
    """The run's recorder: rank 0's journal into the MLflow run, epoch lines on the console."""
    import ray

    from raylane.train.recorder import RunRecorder
    from raylane.train.trainer import journal_path

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


def _outage_stops(call) -> None:
    """`call()` failing fast on each try, with a tracking outage past its window raised as
    the job's one-line error."""
    from raylane.tracking import TrackingError
    from raylane.tracking.runs import TrackingOutageError, fail_fast_tracking

    try:
        with fail_fast_tracking():
            call()
    except TrackingOutageError as outage:
        raise TrackingError(str(outage)) from None


def _recorded(context, *tag_run_args) -> None:
    """The run's context, recorded on a thread during the fit (failing fast there): recorded
    again here, with MLflow's retries, if that failed."""
    try:
        context.result()
    except Exception as exc:  # noqa: BLE001 - a transient error during the fit
        log.warning("run context: %s; recording it again", str(exc).splitlines()[0][:200])
        _tag_run(*tag_run_args)


def _fit_run(cfg: RaylaneConfig, trainer, recorder, register: bool):
    """Fit with the epoch lines on the console and the journal logged as it grows; the result
    and its numeric final metrics. A tracking outage past its window stops the fit."""
    from raylane.tracking.runs import fail_fast_tracking
    from raylane.train.elastic import NodeWatch

    warming = _warm_model_logging() if register else None
    watch = NodeWatch() if cfg.parallelism.elastic else contextlib.nullcontext()
    with fail_fast_tracking(), recorder, watch:
        try:
            result = _fit(trainer)
        except BaseException:
            if recorder.error is None:
                raise
            result = None
    if recorder.error is not None:  # the recorder stopped the fit: the outage is the error
        from raylane.tracking import TrackingError

        raise TrackingError(str(recorder.error)) from None
    if warming is not None:
        warming.join()
    metrics = {
        k: v
        for k, v in result.metrics.items()
        if isinstance(v, int | float) and not k.startswith(MARK_PREFIX)
    }
    return result, metrics


def _log_and_register(final, cfg: RaylaneConfig, metrics: dict[str, float]):
    """Log the final model (torch.export) into the active run, register it, and move the
    champion alias if it is better: (model URI, version, promoted, what happened)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from raylane.tracking.registry import register_if_better

    tracking = cfg.tracking
    log.info("logging and registering the model as %s", tracking.registered_model)
    model_uri, version = _log_model(final, cfg)
    decision = register_if_better(
        MlflowClient(),
        tracking.registered_model,
        version,
        float(metrics[tracking.champion_metric]),
        tracking.champion_alias,
        tracking.champion_metric,
    )
    promotion = decision.describe(tracking.registered_model, tracking.champion_alias)
    mlflow.set_tag("raylane.promotion", promotion)
    log.info(promotion)
    return model_uri, decision.version, decision.promoted, promotion


def _log_model(final, cfg: RaylaneConfig) -> tuple[str, int]:
    """Log and register the run's model: a LoRA run's adapter alone, else the whole model
    (torch.export; a fully fine-tuned one tagged with its base). (model URI, version)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from raylane.data.parquet import read_rows
    from raylane.tracking.lineage import BASE_MODEL_TAG, BASE_VERSION_TAG, register_adapter
    from raylane.tracking.runs import log_trained_model

    run_tags = mlflow.get_run(mlflow.active_run().info.run_id).data.tags
    if cfg.finetune is not None and cfg.finetune.method == "lora":
        with long_step("logging the adapter and registering it"):
            return register_adapter(final, cfg, run_tags)
    with long_step("logging the model (torch.export) and registering it"):
        info = log_trained_model(final, cfg, read_rows(cfg.data.validation_path, cfg, limit=5)[0])
    version = int(info.registered_model_version)
    if cfg.finetune is not None:
        for tag in (BASE_MODEL_TAG, BASE_VERSION_TAG):
            MlflowClient().set_model_version_tag(
                cfg.tracking.registered_model, str(version), tag, run_tags[tag]
            )
    return info.model_uri, version
