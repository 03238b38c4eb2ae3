"""The MLflow run around a training job: its name (or the resumed run's), a fine-tuning run's
base, what the run is tagged with, and each rank's console output kept in it."""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime

from mlflow.entities import RunTag
from mlflow.tracking import MlflowClient

from raylane.config import RaylaneConfig
from raylane.console import long_step
from raylane.tracking.cluster import snapshot_cluster
from raylane.tracking.lineage import BaseModel, log_base_input, pinned_base, resolve_base
from raylane.tracking.runs import log_run_context
from raylane.tracking.worker_logs import keep_worker_logs

log = logging.getLogger("raylane")


def new_run_name(experiment: str) -> str:
    return f"{experiment}-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def run_start(cfg: RaylaneConfig, resume_run_id: str | None) -> tuple[str, dict[str, str]]:
    """The Ray Train run name and `mlflow.start_run` arguments: a new run, or the resumed one
    under its own name (so Ray Train finds its state)."""
    if resume_run_id:
        return MlflowClient().get_run(resume_run_id).info.run_name, {"run_id": resume_run_id}
    run_name = new_run_name(cfg.experiment)
    return run_name, {"run_name": run_name}


def resolve_run_base(
    cfg: RaylaneConfig, tracking_uri: str, resume_run_id: str | None = None
) -> BaseModel | None:
    """A fine-tuning run's base (checked and loaded before Ray starts), else None; a resumed
    run's is the version and weights it recorded."""
    if cfg.finetune is None:
        return None
    expect = None
    if resume_run_id:
        tags = MlflowClient(tracking_uri).get_run(resume_run_id).data.tags
        cfg, expect = pinned_base(cfg, tags), tags.get("raylane.base_digest")
    with long_step(f"loading the base model {cfg.finetune.base}"):
        base = resolve_base(cfg, tracking_uri, expect)
    log.info("fine-tuning %s v%d (%s)", base.name, base.version, cfg.finetune.method)
    return base


@dataclass(frozen=True)
class RunContext:
    """What a job's run is tagged with: the caller's tags; a resumed run is marked, a new one
    gets its whole context (params, config, cluster snapshot, dataset inputs; a fine-tuning
    run its base)."""

    cfg: RaylaneConfig
    tags: dict[str, str] | None
    resume_run_id: str | None
    digest: str
    base: BaseModel | None
    tracking_uri: str

    def record(self, run_id: str) -> None:
        client = MlflowClient(self.tracking_uri)
        if self.tags:
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in self.tags.items()])
        if self.resume_run_id:
            client.set_tag(run_id, "raylane.resumed", "true")  # its base tags: what it trained on
            return
        log_run_context(client, run_id, self.cfg, snapshot_cluster(self.cfg), self.digest)
        if self.base is not None:
            log_base_input(client, run_id, self.base)

    def recorded(self, pending: Future, run_id: str) -> None:
        """The context, recorded on a thread during the fit (failing fast there): recorded
        again here, with MLflow's retries, if that failed."""
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - a transient error during the fit
            log.warning("run context: %s; recording it again", str(exc).splitlines()[0][:200])
            self.record(run_id)


def keep_run_worker_logs(tracking_uri: str, run_id: str, placement: list[dict] | None) -> None:
    """Each rank's console output, read from Ray's log files into the run."""
    if placement is None:  # the worker group never started
        return
    try:
        keep_worker_logs(MlflowClient(tracking_uri), run_id, placement)
    except Exception as exc:  # noqa: BLE001 - never mask how the fit ended
        log.warning("worker logs not kept: %s", exc)
