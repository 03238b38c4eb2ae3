"""Training over the session cluster's two nodes, tracked by a real `mlflow server` (SQL
backend, served artifacts).

One DDP job spreads a worker on each node and is tracked over HTTP; the server goes away after
its first epoch and comes back while it trains. The tests read what that one run recorded:
where its workers ran, what it logged, registered and aliased, and that the outage lost no
epoch. Another, its workers targeting the second node's type by its custom resource, stops
when the server stays away past `tracking.outage_window_s`, and its resume finishes it."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.tracking.runs import OUTAGE
from raylane.train.job import run_training
from raylane.train.journal import JOURNAL_FILE, read_records

from .conftest import REFERENCE, SECOND_NODE_RESOURCE, free_port

EPOCHS = 12  # epochs go on ending after the server stops
EXPERIMENT = "digits-two-nodes"
MODEL = "raylane-digits-server"


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
        yield server
    finally:
        server.stop()
        tracking_utils.set_tracking_uri(saved_uris[0])  # None unsets it
        registry_utils._registry_uri = saved_uris[1]
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class SpreadRun:
    run_id: str
    client: MlflowClient  # over HTTP
    down_ms: tuple[int, int]  # the server surely down: from stopped to being started again
    training_during_outage: bool  # the job still running when the server was started again
    said: str  # what the driver logged (`raylane` logger) while the job ran


@pytest.fixture(scope="module")
def spread_run(second_node, workspace, mlflow_server) -> SpreadRun:
    """The DDP job (2 workers, STRICT_SPREAD: one on each node; gradients top-k compressed
    with error feedback) tracked over HTTP and registered; the server stops once the first
    epoch is in, and starts again, while training goes on, once the workers have ended an
    epoch and the driver has found the server away."""
    cfg = load_config(
        REFERENCE,
        [
            *workspace.overrides(
                f"training.epochs={EPOCHS}",
                "parallelism.placement_strategy=STRICT_SPREAD",
                "parallelism.grad_compression=topk",
                "tracking.system_metrics_interval_s=1",
                f"experiment={EXPERIMENT}",
            ),
            f"tracking.tracking_uri={mlflow_server.url}",
            f"tracking.registered_model={MODEL}",
        ],
    )
    client = MlflowClient(tracking_uri=mlflow_server.url)
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["done"] = run_training(cfg)
        except BaseException as exc:  # noqa: BLE001 - raised again below, in the test's thread
            outcome["error"] = exc

    said = _Said()
    raylane_log = logging.getLogger("raylane")
    raylane_log.addHandler(said)
    level, raylane_log.level = raylane_log.level, logging.INFO
    trainer = threading.Thread(target=train, daemon=True)
    started_s = time.time()
    trainer.start()
    deadline = time.monotonic() + 300
    while not _epochs_logged(client, EXPERIMENT):
        assert trainer.is_alive() and time.monotonic() < deadline, f"no epoch logged: {outcome}"
        time.sleep(0.1)
    mlflow_server.stop()
    stopped_ms = _now_ms()
    # Away until an epoch ended after the stop (rank 0's journal says when) and the driver
    # said the server is unreachable: an order of events, not a time, however slowly a loaded
    # machine's epochs go.
    journal = _journal(Path(cfg.training.storage_path), started_s)
    deadline = time.monotonic() + 300
    while not (_ended_epoch_after(journal, stopped_ms) and OUTAGE in "\n".join(said.lines)):
        assert trainer.is_alive() and time.monotonic() < deadline, f"no outage seen: {outcome}"
        time.sleep(0.1)
    restarting_ms, training = _now_ms(), trainer.is_alive()
    mlflow_server.start()
    trainer.join(timeout=600)
    raylane_log.removeHandler(said)
    raylane_log.setLevel(level)
    if "error" in outcome:
        raise outcome["error"]
    assert "done" in outcome, "training did not finish"
    run_id, down = outcome["done"].run_id, (stopped_ms, restarting_ms)
    return SpreadRun(run_id, client, down, training, "\n".join(said.lines))


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _now_ms() -> int:
    return int(time.time() * 1000)


def _journal(runs: Path, since_s: float) -> Path:
    """The journal of the one run started after `since_s` (by then it has logged an epoch)."""
    (found,) = [path for path in runs.glob(f"*/{JOURNAL_FILE}") if path.stat().st_mtime > since_s]
    return found


def _ended_epoch_after(journal: Path, at_ms: int) -> bool:
    records, _ = read_records(journal, 0)
    # The epoch's metrics carry this time, in whole milliseconds.
    return any(r["kind"] == "epoch" and int(r["time"] * 1000) > at_ms for r in records)


def _epochs_logged(client: MlflowClient, experiment: str) -> bool:
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return bool(runs) and bool(client.get_metric_history(runs[0].info.run_id, "val_loss"))


def _artifact(client: MlflowClient, run_id: str, path: str) -> dict:
    return json.loads(Path(client.download_artifacts(run_id, path)).read_text())


def _placement(client: MlflowClient, run_id: str) -> list[dict]:
    """Each rank's node, from the run; and each node that ran workers sampled itself into the
    run's System metrics."""
    placement = _artifact(client, run_id, "parallel/placement.json")["ranks"]
    metrics = client.get_run(run_id).data.metrics
    for rank in placement:
        for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
            assert f"system/{rank['node']}/{name}" in metrics, sorted(metrics)
    return placement


def test_ddp_workers_spread_over_both_nodes_and_the_run_records_them(spread_run, second_node):
    client, run_id = spread_run.client, spread_run.run_id
    placement = _placement(client, run_id)
    worker_nodes = {rank["node_id"] for rank in placement}
    assert len(placement) == 2 and len(worker_nodes) == 2
    assert len({rank["node"] for rank in placement}) == 2  # two nodes in System metrics
    snapshot = _artifact(client, run_id, "cluster/snapshot.json")
    assert worker_nodes == {node["node_id"] for node in snapshot["nodes"]}
    assert second_node in worker_nodes


def test_training_job_logs_registers_and_aliases_over_http(spread_run):
    client, run_id = spread_run.client, spread_run.run_id
    # Per-epoch metrics come from rank 0's journal, logged by the driver over HTTP.
    history = client.get_metric_history(run_id, "val_accuracy")
    assert [m.step for m in history] == list(range(EPOCHS))
    assert client.get_model_version_by_alias(MODEL, "champion").run_id == run_id
    paths = {a.path for a in client.list_artifacts(run_id, "cluster")}
    assert "cluster/snapshot.json" in paths


def test_topk_with_error_feedback_learns_digits_across_the_nodes(spread_run):
    client, run_id = spread_run.client, spread_run.run_id

    def first_three(key: str) -> list[float]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        return [m.value for m in history[:3]]

    # Chance is 0.1; measured 0.694 after 3 epochs at 1 % of the entries per step (each
    # parameter's left-out residual added back to its own entries: tests/unit/test_proof_replicas).
    assert first_three("val_accuracy")[2] >= 0.6
    losses = first_three("train_loss")
    assert losses[2] < losses[1] < losses[0], losses  # 1 % of the entries per step: slower
    assert all(ratio < 0.05 for ratio in first_three("comm_bytes_ratio"))


def test_a_tracking_outage_mid_run_loses_no_epoch(spread_run):
    """Training does not stop while the server is away, and every epoch's metrics, those that
    ended during the outage too, are in MLflow afterwards."""
    client, run_id = spread_run.client, spread_run.run_id
    assert spread_run.training_during_outage
    history = client.get_metric_history(run_id, "val_loss")
    assert [m.step for m in history] == list(range(EPOCHS))
    # Metrics carry the time their epoch ended: some ended while the server was down.
    down_from, down_to = spread_run.down_ms
    assert any(down_from < m.timestamp < down_to for m in history), (spread_run.down_ms, history)
    assert client.get_run(run_id).info.status == "FINISHED"
    # The driver, which logs the run, said so on its console.
    assert "tracking server unreachable" in spread_run.said, spread_run.said[-2000:]
    assert "tracking server back" in spread_run.said


def test_an_outage_past_its_window_stops_the_run_and_its_resume_finishes_it(
    ray_cluster, second_node, workspace, mlflow_server, tmp_path
):
    """`raylane train` whose server goes away for longer than the run's window (2 s): the run
    stops with one line naming the outage and the command that resumes it; with the server
    back, that resume trains the epochs left from the kept checkpoint, and every epoch is
    logged once. Its workers target the second node's type by its custom resource."""
    experiment, epochs = "outage-past-window", 5
    overrides = [
        *workspace.overrides(
            f"training.epochs={epochs}",
            f"experiment={experiment}",
            "tracking.outage_window_s=2",
            "parallelism.straggler={rank: 0, delay_s: 0.2}",  # epochs of seconds
            "tracking.system_metrics_interval_s=1",
            f"parallelism.resources_per_worker={{CPU: 0.5, {SECOND_NODE_RESOURCE}: 1}}",
        ),
        f"tracking.tracking_uri={mlflow_server.url}",
    ]
    command = [sys.executable, "-m", "raylane.cli", "train"]
    command += [arg for item in overrides for arg in ("--set", item)]
    env = {**ray_cluster.client_env, "RAY_ADDRESS": ray_cluster.address, "COLUMNS": "200"}
    client = MlflowClient(tracking_uri=mlflow_server.url)
    log = tmp_path / "train.log"
    with log.open("w") as out:
        train = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not _epochs_logged(client, experiment):
                assert train.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            mlflow_server.stop()
            stopped = time.monotonic()
            code = train.wait(timeout=300)
            # Window and exit, not MLflow's minutes of retries on each call after the fit.
            assert time.monotonic() - stopped < 120, log.read_text()[-3000:]
        finally:
            if train.poll() is None:
                train.kill()
            mlflow_server.start()
    console = log.read_text()
    assert code == 2, console[-3000:]  # a user-facing error, not a crash
    (said,) = [line for line in console.splitlines() if line.startswith(f"error: {OUTAGE}")]
    assert "(tracking.outage_window_s 2)" in said, said
    run_id = re.search(r"`raylane train --resume ([0-9a-f]{32})` once it is back", said)[1]
    logged = [m.step for m in client.get_metric_history(run_id, "val_loss")]
    assert logged == list(range(len(logged))) and 0 < len(logged) < epochs - 1, logged

    resumed = subprocess.run(
        [sys.executable, "-m", "raylane.cli", "train", "--resume", run_id],
        env={**env, "MLFLOW_TRACKING_URI": mlflow_server.url},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    history = client.get_metric_history(run_id, "val_loss")
    assert [m.step for m in history] == list(range(epochs))  # each epoch once
    assert client.get_run(run_id).info.status == "FINISHED"
    placement = _placement(client, run_id)  # the resumed group's: on that node again
    assert [rank["node_id"] for rank in placement] == [second_node, second_node]
