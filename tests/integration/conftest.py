"""One real Ray cluster (`ray start --head`, token auth on) and one MLflow store per session."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "configs" / "train" / "digits_ddp.yaml"
BIN = Path(sys.executable).parent
SECOND_NODE_RESOURCE = "node_b"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RayCluster:
    address: str
    dashboard_url: str
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
def ray_cluster(tmp_path_factory):
    """A real two-node cluster on this machine: a head (`ray start --head`, 4 logical CPUs)
    and a second node (`ray start --address`, 2 CPUs and the custom resource `node_b`), with
    token authentication on.

    The token lives in a file of this session (RAY_AUTH_TOKEN_PATH), so tests neither read nor
    write ~/.ray/auth_token. The test process and every client it starts share that setting.
    """
    tmp = tmp_path_factory.mktemp("ray")
    token_path = tmp / "auth_token"
    token_path.write_text(uuid.uuid4().hex)
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "PATH")}
    os.environ.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        # Jobs run with the `python` found on PATH when the head started: this venv's.
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    gcs_port, dashboard_port = free_port(), free_port()
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
            "--num-cpus=4",
            "--disable-usage-stats",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    address = f"127.0.0.1:{gcs_port}"
    subprocess.run(
        [
            ray_cli,
            "start",
            f"--address={address}",
            "--num-cpus=2",
            f"--resources={json.dumps({SECOND_NODE_RESOURCE: 2})}",
            "--disable-usage-stats",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # Imported only now: Ray reads RAY_AUTH_MODE once, when it is first imported.
    import ray

    try:
        ray.init(address=address, logging_level="WARNING")
        _wait_for_nodes(ray, 2)
        yield RayCluster(
            address=address,
            dashboard_url=f"http://127.0.0.1:{dashboard_port}",
            token_path=token_path,
            client_env=dict(os.environ),
        )
    finally:
        ray.shutdown()
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_for_nodes(ray, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(node["Alive"] for node in ray.nodes()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not reach {count} nodes in {timeout_s:.0f} s")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("workspace")
    return Workspace(root=root, tracking_uri=f"sqlite:///{root}/mlflow.db")


@pytest.fixture(scope="session")
def trained(ray_cluster, workspace):
    """The reference DDP job (2 workers, Ray Data over Parquet), run once for the session."""
    from raylane.config import load_config
    from raylane.train.job import run_training

    cfg = load_config(REFERENCE, workspace.overrides("training.epochs=8"))
    return cfg, run_training(cfg)


def ray_cli_path() -> str:
    return shutil.which("ray", path=str(BIN)) or "ray"
