"""MLflow runs of training jobs: params, config, cluster snapshot, datasets, metrics, model."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
import numpy as np
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from raylane.config import RaylaneConfig
from raylane.config.layout import describe_stages
from raylane.config.loader import config_to_yaml, flatten
from raylane.data.files import TOKENIZER_FILE
from raylane.data.parquet import dataset_digest
from raylane.tracking.step_plot import STEP_SPLIT_ARTIFACT

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("raylane")

CONFIG_ARTIFACT = "config/resolved.yaml"
SNAPSHOT_ARTIFACT = "cluster/snapshot.json"
LAYOUT_ARTIFACT = "parallel/stage_layout.txt"
PLACEMENT_ARTIFACT = "parallel/placement.json"
DIFF_ARTIFACT = "code/git_diff.patch"
REQUIREMENTS_ARTIFACT = "environment/requirements.txt"


def log_run_context(
    client: MlflowClient, run_id: str, cfg: RaylaneConfig, snapshot: dict[str, Any], digest: str
) -> None:
    """Into the run: flattened params, resolved config, cluster snapshot, dataset inputs.

    Through an explicit client (not the fluent API's active run), so the driver can record it
    on a thread while Ray starts the worker group."""
    from mlflow.entities import Param, RunTag

    params = {k: str(v)[:500] for k, v in flatten(cfg.model_dump(mode="json")).items()}
    layout = cfg.parallelism.dims
    params = [Param(k, v) for k, v in {**params, **layout.as_params()}.items()]
    for start in range(0, len(params), 100):  # MLflow's limit of params per batch
        client.log_batch(run_id, params=params[start : start + 100])
    client.log_text(run_id, config_to_yaml(cfg), CONFIG_ARTIFACT)
    code = snapshot["code"]
    diff = code.pop("git_diff", None)
    client.log_dict(run_id, snapshot, SNAPSHOT_ARTIFACT)
    if diff:
        client.log_text(run_id, diff, DIFF_ARTIFACT)  # a dirty tree: what differs from the commit
    lines = [f"layout: {layout.describe()}", *describe_stages(cfg)]
    client.log_text(run_id, "\n".join(lines) + "\n", LAYOUT_ARTIFACT)
    tags = {
        "raylane.strategy": cfg.parallelism.strategy,
        "raylane.layout": layout.describe(),
        "raylane.workers": str(cfg.parallelism.workers),
        "raylane.nodes": str(len(snapshot["nodes"])),
        "raylane.dataset_digest": digest,
        "raylane.seed": str(cfg.training.seed),
        "mlflow.source.git.commit": code["git_commit"] or "unknown",
        "raylane.git_dirty": str(code["git_dirty"]),
        **cfg.model.factory_tags(),  # a custom model: its factory and its source's sha256
    }
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    _log_dataset_inputs(client, run_id, cfg, digest)
    prepared = Path(cfg.data.train_path).parent
    # Prepared text datasets record which files (and bytes) they were made from, and the
    # tokenizer their tokens come from (a trained BPE or the one given; bytes need none).
    for name in ("manifest.json", TOKENIZER_FILE):
        if (prepared / name).is_file():
            client.log_artifact(run_id, str(prepared / name), "data")


def _log_dataset_inputs(client: MlflowClient, run_id: str, cfg: RaylaneConfig, digest: str):
    from mlflow.data.dataset_source_registry import get_registered_sources, resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    # MLflow registers two identical local-file sources ('file' and '' schemes) and warns that
    # a path is ambiguous between them; naming the first one resolves it.
    local = [s for s in get_registered_sources() if s._get_source_type() == "local"][:1]
    inputs = []
    for context, path in (
        ("training", cfg.data.train_path),
        ("validation", cfg.data.validation_path),
    ):
        source = resolve_dataset_source(str(Path(path).resolve()), candidate_sources=local)
        dataset = MetaDataset(
            source=source, name=f"{cfg.data.source}-{context}", digest=dataset_digest(Path(path))
        )
        tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)]
        tags.append(InputTag("raylane.dataset_digest", digest))
        inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=tags))
    client.log_inputs(run_id, datasets=inputs)


FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@contextlib.contextmanager
def fail_fast_tracking() -> Iterator[None]:
    """MLflow's HTTP calls fail at once while this is open (no retries, 10 s timeout) unless
    the environment sets otherwise: the driver holds metrics back through an outage and tries
    again within a second, instead of MLflow's minutes of retries."""
    saved = {name: os.environ.get(name) for name in FAIL_FAST}
    for name, value in FAIL_FAST.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)


class TrackingOutageError(RuntimeError):
    """The tracking server stayed away longer than the outage window."""


OUTAGE = "tracking server unreachable"


EPOCH_KEY = "val_loss"  # a metric every epoch logs, at the epoch's step


class EpochLogger:
    """Logs per-epoch metrics into an existing run (the driver, from rank 0's journal).

    A tracking server that goes away does not stop training: metrics wait in memory and go out
    with the next epoch's (or at `close`), as long as the server is back within
    `outage_window_s`; past it the run stops with one line and stays resumable from its
    checkpoints.
    """

    def __init__(self, tracking_uri: str, run_id: str, outage_window_s: float = 300.0):
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self._uri = tracking_uri
        self._run_id = run_id
        self._window_s = outage_window_s
        self._pending: list[Metric] = []
        self._down_since: float | None = None

    def log_placement(self, placement: list[dict]) -> None:
        """Which node (and process) each rank runs on: the layout as it really was."""
        self._client.log_dict(self._run_id, {"ranks": placement}, PLACEMENT_ARTIFACT)

    def log_code_identity(self, placement: list[dict], requirements: str) -> None:
        """The raylane code the workers imported (one digest: `check_same_code` ran first)
        and the packages of the workers' environment (`identity.requirements` there)."""
        self._client.set_tag(self._run_id, "raylane.code_digest", placement[0]["code_digest"])
        self._client.set_tag(self._run_id, "raylane.code_path", placement[0]["code_path"])
        self._client.log_text(self._run_id, requirements, REQUIREMENTS_ARTIFACT)

    def log_tables(self, tables: dict[str, dict]) -> None:
        """JSON artifacts a strategy keeps for the run (e.g. its staleness histogram); they
        are rewritten each epoch. Best effort: an outage loses only the latest copy."""
        for name, table in tables.items():
            try:
                self._client.log_dict(self._run_id, table, f"{name}.json")
            except Exception as exc:  # noqa: BLE001 - metrics matter more; say it and go on
                log.warning("%s.json not logged: %s", name, exc)

    def log_step_split(self, png: bytes) -> None:
        """The per-epoch step-time split figure (`step_split_png`) as `step_time_split.png`."""
        try:
            with tempfile.TemporaryDirectory(prefix="raylane-figure-") as folder:
                path = Path(folder) / STEP_SPLIT_ARTIFACT
                path.write_bytes(png)
                self._client.log_artifact(self._run_id, str(path))
        except Exception as exc:  # noqa: BLE001
            log.warning("%s not logged: %s", STEP_SPLIT_ARTIFACT, exc)

    def log(self, metrics: dict[str, float], step: int, at: float | None = None) -> None:
        """Metrics at `step`, stamped `at` (when they were measured; now by default)."""
        stamp = int((time.time() if at is None else at) * 1000)
        self._pending += [
            Metric(key, float(value), stamp, step)
            for key, value in metrics.items()
            if key != "epoch"
        ]
        if not self._flush():
            self._check_window()

    def log_epoch(
        self, metrics: dict[str, float], epoch: int, again: bool = False, at: float | None = None
    ) -> bool:
        """An epoch's metrics, once. A group restarted from a checkpoint taken before the end
        of the epoch it starts in (`again`: a resize, a preemption, a failure) trains that
        epoch's last steps again and reaches the same end; if the run already holds that
        epoch, its first record is kept. Whether the metrics were logged now."""
        if again and self.holds(epoch):
            log.info(
                "epoch %d ended again after a restart; its metrics were logged the first time "
                "and are kept as they are",
                epoch + 1,
            )
            return False
        self.log(metrics, step=epoch, at=at)
        return True

    def holds(self, epoch: int) -> bool:
        """Whether the run has `epoch`'s metrics (False when the store cannot say: an outage
        is waited out by `log` as for any epoch)."""
        try:
            history = self._client.get_metric_history(self._run_id, EPOCH_KEY)
        except Exception:  # noqa: BLE001
            return False
        return any(m.step == epoch for m in history)

    def close(self) -> None:
        """Send what is still pending, waiting for the server up to the outage window."""
        while not self._flush():
            self._check_window()
            time.sleep(1.0)

    def _flush(self) -> bool:
        try:
            for start in range(0, len(self._pending), 1000):  # MLflow's batch limit
                self._client.log_batch(self._run_id, metrics=self._pending[start : start + 1000])
        except Exception as exc:  # any failure to reach the store is an outage to wait out
            if self._down_since is None:
                self._down_since = time.monotonic()
                reason = str(exc).splitlines()[0][:200]
                log.warning("%s (%s); metrics are kept and sent when it is back", OUTAGE, reason)
            return False
        if self._down_since is not None:
            away = time.monotonic() - self._down_since
            log.warning("tracking server back after %.0f s", away)
        self._pending.clear()
        self._down_since = None
        return True

    def _check_window(self) -> None:
        if self._down_since is None:
            return
        away = time.monotonic() - self._down_since
        if away > self._window_s:
            steps = sorted({m.step for m in self._pending})
            raise TrackingOutageError(
                f"{OUTAGE} for {away:.0f} s (tracking.outage_window_s {self._window_s:g}) at "
                f"{self._uri}: epochs {steps[0] + 1}-{steps[-1] + 1} not logged; checkpoints are "
                f"kept: `raylane train --resume {self._run_id}` once it is back"
            )


def log_trained_model(model: nn.Module, cfg: RaylaneConfig, example: np.ndarray):
    """Log the model (with signature and input example) and register a new version of it."""
    import torch
    from mlflow.models import infer_signature

    model = model.eval()
    if len(example) < 2:
        # torch.export specializes a dimension of size 1: a 1-row example would give a model
        # that refuses every batch of more than one row.
        example = np.concatenate([example, example])
    with torch.no_grad():
        output = model(torch.from_numpy(example)).numpy()
    return mlflow.pytorch.log_model(
        model,
        name="model",
        input_example=example,
        signature=infer_signature(example, output),
        registered_model_name=cfg.tracking.registered_model,
        pip_requirements=model_requirements(),
    )


def model_requirements() -> list[str]:
    """What loading a logged model needs, pinned to this environment's versions.

    Local version labels (torch's `+cpu`) are dropped: they are not on PyPI, and a GPU host
    installs its own build of the same release.
    """
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in ("torch", "mlflow", "numpy")]
