"""One real Ray cluster (`ray start --head`, token auth on) and one MLflow store per session."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "configs" / "train" / "digits_ddp.yaml"
BIN = Path(sys.executable).parent
SECOND_NODE_RESOURCE = "node_b"

# Ray reads RAY_AUTH_MODE once, when it is first imported, and test modules import Ray at
# collection: token authentication is configured here, before any of them. The token lives in a
# file of this session (RAY_AUTH_TOKEN_PATH), so tests neither read nor write ~/.ray/auth_token;
# the test process and every client it starts share it.
TOKEN_DIR = Path(tempfile.mkdtemp(prefix="raylane-test-auth-"))
TOKEN_PATH = TOKEN_DIR / "auth_token"
TOKEN_PATH.write_text(uuid.uuid4().hex)
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(TOKEN_PATH))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RayCluster:
    address: str
    dashboard_url: str
    metrics_url: str
    token_path: Path
    client_env: dict[str, str] = field(repr=False)


@dataclass
class Workspace:
    root: Path
    tracking_uri: str

    def overrides(self, *extra: str) -> list[str]:
        """Overrides that keep data, runs and the MLflow store inside this session's temp dir."""
        return [
            f"data.train_path={self.root}/data/train.parquet",
            f"data.validation_path={self.root}/data/validation.parquet",
            f"training.storage_path={self.root}/runs",
            f"tracking.tracking_uri={self.tracking_uri}",
            *extra,
        ]


@pytest.fixture(scope="session")
def ray_cluster():
    """A head node started with `ray start --head` (4 logical CPUs), token authentication on
    (see TOKEN_PATH above). `second_node` adds a node for the tests that need two."""
    from raylane.serving.ingress import DRAIN_ENV, LOCAL_DRAIN_S, ingress_env

    saved_path = os.environ.get("PATH", "")
    # Jobs run with the `python` found on PATH when the head started: this venv's.
    os.environ["PATH"] = f"{BIN}{os.pathsep}{saved_path}"
    # Serve's ingress is chosen by the environment of `ray start`, as on a user's cluster: the
    # default, HAProxy. Its stats page and exporter get free ports (fixed ones by default).
    # No load balancer stands in front of this cluster's HAProxy: stopping replicas drain for
    # raylane's local period (seconds), not Serve's 30 s; the upgrade-under-load test holds
    # that to zero failed requests.
    os.environ.update(
        {**ingress_env("haproxy"), DRAIN_ENV: LOCAL_DRAIN_S},
        RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()),
        RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()),
    )
    gcs_port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    ray_cli = str(BIN / "ray")
    subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--metrics-export-port={metrics_port}",
            f"--ray-client-server-port={free_port()}",  # README blocks `ray start` the default
            "--num-cpus=4",
            "--disable-usage-stats",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    address = f"127.0.0.1:{gcs_port}"
    import ray

    try:
        ray.init(address=address, logging_level="WARNING")
        yield RayCluster(
            address=address,
            dashboard_url=f"http://127.0.0.1:{dashboard_port}",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            token_path=TOKEN_PATH,
            client_env=dict(os.environ),
        )
    finally:
        from raylane.serving.leftovers import stop_leftover_ingress

        ray.shutdown()
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120)
        # `ray stop` leaves Serve's HAProxy running, orphaned: nothing may outlive the suite.
        stop_leftover_ingress(None)
        os.environ["PATH"] = saved_path
        shutil.rmtree(TOKEN_DIR, ignore_errors=True)


def _wait_for_nodes(ray, count: int, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(node["Alive"] for node in ray.nodes()) != count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not reach {count} nodes in {timeout_s:.0f} s")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def second_node(ray_cluster):
    """A second real node (`ray start --address`, 2 CPUs, custom resource `node_b`) joined to
    the session cluster for one test module, then stopped."""
    import ray

    process = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            f"--address={ray_cluster.address}",
            "--num-cpus=2",
            f"--resources={json.dumps({SECOND_NODE_RESOURCE: 2})}",
            "--disable-usage-stats",
            "--block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_nodes(ray, 2)
        yield next(
            node["NodeID"]
            for node in ray.nodes()
            if node["Alive"] and SECOND_NODE_RESOURCE in node["Resources"]
        )
    finally:
        process.terminate()
        process.wait(timeout=120)
        _wait_for_nodes(ray, 1)


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("workspace")
    return Workspace(root=root, tracking_uri=f"sqlite:///{root}/mlflow.db")


@pytest.fixture(scope="session")
def trained(ray_cluster, workspace):
    """The reference DDP job (2 workers, Ray Data over Parquet), run once for the session,
    checkpointing every 4 steps as well as every epoch.

    It reads through Ray Data (streaming splits); every other job of the suite uses the memory
    feed, which `auto` picks for data this small."""
    from raylane.config import load_config
    from raylane.train.job import run_training

    cfg = load_config(
        REFERENCE,
        workspace.overrides(
            *TRAINED,
            "tracking.system_metrics_interval_s=1",
        ),
    )
    return cfg, run_training(cfg)


#: What the reference job of `trained` computes (a run that continues it must say the same).
TRAINED = ("training.epochs=8", "data.feed=ray_data", "training.checkpoint_every_steps=4")


def ray_cli_path() -> str:
    return shutil.which("ray", path=str(BIN)) or "ray"


def lm_overrides(workspace: Workspace, *extra: str) -> list[str]:
    """The byte-level GPT on a small slice of the standard library, inside the workspace."""
    return [
        *workspace.overrides(*extra),
        f"data.train_path={workspace.root}/lm/train.parquet",
        f"data.validation_path={workspace.root}/lm/validation.parquet",
        "data.max_bytes=131072",
    ]


@pytest.fixture(scope="session")
def pipeline_run(ray_cluster, workspace):
    """The reference pipeline job (pp=2, GPipe, 2 epochs), run once for the session.

    Its failure budget (one worker-group restart) is recorded with it, so `raylane reproduce`
    of it survives a killed stage: test_recovery.py kills one during the reproduction."""
    from raylane.config import load_config
    from raylane.train.job import run_training

    config = ROOT / "configs" / "train" / "lm_pipeline.yaml"
    overrides = lm_overrides(workspace, "training.epochs=2", "training.max_failures=1")
    cfg = load_config(config, overrides)
    return cfg, run_training(cfg)


@dataclass
class MeasuredProfile:
    config: object  # the RaylaneConfig it was measured for
    profile: dict
    run_id: str
    reused: bool  # False: this call ran the profile job


@pytest.fixture(scope="session")
def lm_profile(ray_cluster, workspace) -> MeasuredProfile:
    """The byte-level GPT profiled once for the session at 1 and 2 workers, in the session's
    MLflow store: the first `load_or_measure` of its key. Its config is the one a DDP search
    over 1 and 2 workers of `lm_pipeline.yaml` profiles (the same key), so such a search
    reuses it."""
    from raylane.config import load_config
    from raylane.profile.job import load_or_measure

    cfg = load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        lm_overrides(
            workspace, "parallelism.strategy=ddp", "parallelism.pp=1", "parallelism.workers=2"
        ),
    )
    found, run_id, reused = load_or_measure(cfg, workspace.tracking_uri, concurrency=[1, 2])
    return MeasuredProfile(cfg, found, run_id, reused)
