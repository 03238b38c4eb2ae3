"""A finished job's model: assembled from its last checkpoint, its weights' digest tagged on
the run, then (unless a reproduction) logged into the run and registered, the champion alias
moved if it is better."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from raylane.config import RaylaneConfig
from raylane.console import long_step
from raylane.data.parquet import read_rows
from raylane.models import build_model
from raylane.models.adapters import apply_lora
from raylane.tracking.identity import weights_digest
from raylane.tracking.lineage import BASE_MODEL_TAG, BASE_VERSION_TAG, register_adapter
from raylane.tracking.registry import register_if_better
from raylane.tracking.runs import log_trained_model
from raylane.train.checkpointing import load_model_state

log = logging.getLogger("raylane")


def warm_model_logging() -> threading.Thread:
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


def record_model(cfg: RaylaneConfig, checkpoint, metrics: dict, register: bool):
    """Tag the run with its last checkpoint and its weights' digest; log and register the
    assembled model unless `register` is off. `(uri, version, promoted, promotion)` or None."""
    mlflow.set_tag("raylane.checkpoint", checkpoint.path)
    final = final_model(cfg, checkpoint)
    mlflow.set_tag("raylane.weights_digest", weights_digest(final.state_dict()))
    return _log_and_register(final, cfg, metrics) if register else None


def final_model(cfg: RaylaneConfig, checkpoint):
    """The whole model of a Ray Train checkpoint, in eval mode (a LoRA run's base and
    adapter)."""
    model = build_model(cfg.model)
    if cfg.finetune is not None and cfg.finetune.method == "lora":
        apply_lora(model, cfg.finetune)  # the checkpoint holds base and adapter tensors
    with checkpoint.as_directory() as directory:
        model.load_state_dict(load_model_state(Path(directory)))
    return model.eval()


def _log_and_register(final, cfg: RaylaneConfig, metrics: dict[str, float]):
    """Log the final model (torch.export) into the active run, register it, and move the
    champion alias if it is better: (model URI, version, promoted, what happened)."""
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
        tracking.champion_higher_is_better,
    )
    promotion = decision.describe(tracking.registered_model, tracking.champion_alias)
    mlflow.set_tag("raylane.promotion", promotion)
    log.info(promotion)
    return model_uri, decision.version, decision.promoted, promotion


def _log_model(final, cfg: RaylaneConfig) -> tuple[str, int]:
    """Log and register the run's model: a LoRA run's adapter alone, else the whole model
    (torch.export; a fully fine-tuned one tagged with its base). (model URI, version)."""
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
