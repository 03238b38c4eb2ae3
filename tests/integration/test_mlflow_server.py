"""A real `mlflow server` (SQL backend, served artifacts): a training job spread over two nodes
logs, registers and aliases over HTTP; its rank-0 worker reaches the server from its node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.train.job import run_training

from .conftest import REFERENCE, free_port


class MlflowServer:
    """A real `mlflow server` process on a free port; `stop()` and `start()` again keep its
    store and address, as a restarted server would."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
               "MLFLOW_DISABLE_TELEMETRY": "true"}  # fmt: skip
        self.process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "mlflow"), "server",
                "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
                "--artifacts-destination", str(self.root / "artifacts"),
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            ],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not answer in 90 s"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The server, and afterwards the process's MLflow URIs as they were: the jobs here point
    this process's MLflow at the server, which later modules must not inherit."""
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    # The URIs as set (None: unset, derived), not as resolved.
    saved_uris = tracking_utils._tracking_uri, registry_utils._registry_uri
    saved_env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
        tracking_utils.set_tracking_uri(saved_uris[0])  # None unsets it
        registry_utils._registry_uri = saved_uris[1]
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_training_job_logs_registers_and_aliases_over_http(second_node, workspace, mlflow_server):
    cfg = load_config(
        REFERENCE,
        [
            *workspace.overrides(
                "training.epochs=2", "parallelism.placement_strategy=STRICT_SPREAD"
            ),
            f"tracking.tracking_uri={mlflow_server}",
            "tracking.registered_model=raylane-digits-server",
        ],
    )
    outcome = run_training(cfg)
    client = MlflowClient(tracking_uri=mlflow_server)
    # Per-epoch metrics come from the rank-0 worker, over HTTP.
    history = client.get_metric_history(outcome.run_id, "val_accuracy")
    assert [m.step for m in history] == [0, 1]
    champion = client.get_model_version_by_alias("raylane-digits-server", "champion")
    assert champion.run_id == outcome.run_id
    paths = {a.path for a in client.list_artifacts(outcome.run_id, "cluster")}
    assert "cluster/snapshot.json" in paths
    placement = client.download_artifacts(outcome.run_id, "parallel/placement.json")
    nodes = {rank["node_id"] for rank in json.loads(Path(placement).read_text())["ranks"]}
    assert len(nodes) == 2 and second_node in nodes


def test_a_tracking_outage_mid_run_loses_no_epoch(ray_cluster, workspace, tmp_path):
    """The server goes away after the first epoch and comes back while training goes on:
    training does not stop, and every epoch's metrics are in MLflow afterwards."""
    server = MlflowServer(tmp_path)
    server.start()
    epochs = 12
    cfg = load_config(
        REFERENCE,
        [
            *workspace.overrides(f"training.epochs={epochs}"),
            f"tracking.tracking_uri={server.url}",
            "tracking.registered_model=raylane-digits-outage",
            "tracking.system_metrics_interval_s=0",
            "experiment=digits-outage",
        ],
    )
    client = MlflowClient(tracking_uri=server.url)
    outcome: dict = {}

    def train() -> None:
        outcome.update(done=run_training(cfg, register=False))  # nobody reads its model

    trainer = threading.Thread(target=train)
    try:
        trainer.start()
        deadline = time.monotonic() + 300
        while not _epochs_logged(client, "digits-outage"):
            assert trainer.is_alive() and time.monotonic() < deadline, "no epoch logged"
            time.sleep(0.1)
        server.stop()
        time.sleep(8)  # training goes on meanwhile
        assert trainer.is_alive()
        server.start()
        trainer.join(timeout=600)
        assert "done" in outcome, "training did not finish"
        run_id = outcome["done"].run_id
        history = client.get_metric_history(run_id, "val_loss")
        assert sorted({m.step for m in history}) == list(range(epochs))
        assert client.get_run(run_id).info.status == "FINISHED"
        worker_log = Path(client.download_artifacts(run_id, "logs/rank-0.err")).read_text()
        assert "tracking server unreachable" in worker_log, worker_log[-2000:]
        assert "tracking server back" in worker_log
    finally:
        server.stop()


def _epochs_logged(client: MlflowClient, experiment: str) -> bool:
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return bool(runs) and bool(client.get_metric_history(runs[0].info.run_id, "val_loss"))
