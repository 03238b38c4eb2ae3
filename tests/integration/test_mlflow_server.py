"""A real `mlflow server` (SQL backend, served artifacts): a training job spread over two nodes
logs, registers and aliases over HTTP; its rank-0 worker reaches the server from its node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.train.job import run_training

from .conftest import REFERENCE, free_port


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true"}  # fmt: skip
    process = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"), "server",
            "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination", str(root / "artifacts"),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not answer in 90 s"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


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
