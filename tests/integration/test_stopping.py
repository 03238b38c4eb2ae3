"""SIGTERM, what systemd, `docker stop`, Kubernetes and supervisors send, stops a command as
Ctrl-C does: its clean-up runs, it says so in one line, exits 143, and leaves nothing running."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from raylane.serving.leftovers import ingress_ports

from .conftest import BIN, REFERENCE, free_port


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [str(BIN / "raylane"), *args],
            env={**env, "COLUMNS": "200"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the suite's own signals stay away from it
        )


def _wait_for(log: Path, text: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {text!r} (exit {process.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _sets(overrides: list[str]) -> list[str]:
    return [part for item in overrides for part in ("--set", item)]


def _terminate(process: subprocess.Popen, log: Path) -> tuple[int, str, list[psutil.Process]]:
    """SIGTERM to the command's own process (as `docker stop` sends it to PID 1); its exit
    status, its output and the processes it had started."""
    started = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"running 120 s after SIGTERM:\n{log.read_text()[-3000:]}") from None
    return code, log.read_text(), started


def _still_running(processes: list[psutil.Process], grace_s: float = 15.0) -> list[str]:
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    return [f"{p.pid} {p.name()}" for p in alive if p.is_running()]


def _listening(ports: set[int]) -> set[int]:
    """Which of these ports a socket listens on. A connection's TIME_WAIT left on a port, or
    another process's outgoing connection that the kernel gave it, is no listener."""
    tcp = psutil.net_connections(kind="tcp")
    return {c.laddr.port for c in tcp if c.status == psutil.CONN_LISTEN} & ports


def test_sigterm_stops_deploy_like_ctrl_c_and_leaves_nothing_running(trained, workspace, tmp_path):
    cfg, outcome = trained  # its model is the registry's champion
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    log = tmp_path / "deploy.log"
    args = ["deploy", "--config", str(REFERENCE)]
    process = _start([*args, *_sets(workspace.overrides(f"serving.port={port}"))], env, log)
    _wait_for(log, "serving; press Ctrl-C to stop", process, timeout_s=240)

    code, output, started = _terminate(process, log)

    assert code == 143, output[-3000:]
    assert "stopping (SIGTERM)" in output
    assert output.rstrip().splitlines()[-1] == "stopped (SIGTERM)", output[-1000:]
    assert f"stopped: Serve app ({cfg.tracking.registered_model} v" in output
    assert "*** SIGTERM received" not in output  # Ray's own handler did not take it
    assert not _still_running(started)  # Ray's daemons, agents, Serve's actors and HAProxy
    assert not _listening(ingress_ports(port))


def test_sigterm_stops_a_training_run_on_a_cluster(ray_cluster, workspace, tmp_path):
    import ray
    from ray.util.state import list_actors

    def trainers() -> set[str]:
        """The Ray Train actors alive on the cluster: a controller and workers per job."""
        alive = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        return {a.actor_id for a in alive if a.class_name in ("TrainController", "RayTrainWorker")}

    earlier = trainers()  # other jobs' (this session's finished runs may keep theirs)
    env = {**ray_cluster.client_env, "RAY_ADDRESS": ray_cluster.address}
    log = tmp_path / "train.log"
    overrides = workspace.overrides("training.epochs=200", "tracking.system_metrics_interval_s=0")
    process = _start(["train", "--config", str(REFERENCE), *_sets(overrides)], env, log)
    _wait_for(log, "MLflow run", process, timeout_s=180)

    deadline = time.monotonic() + 120
    while len(trainers() - earlier) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    mine = trainers() - earlier
    assert len(mine) == 3, mine  # its controller and 2 workers

    code, output, _ = _terminate(process, log)

    assert code == 143, output[-3000:]
    assert output.rstrip().splitlines()[-1] == "stopped (SIGTERM)", output[-1000:]
    assert "*** SIGTERM received" not in output
    deadline = time.monotonic() + 30
    while mine & trainers() and time.monotonic() < deadline:  # they end with their driver
        time.sleep(0.5)
    assert not mine & trainers()
    assert ray.is_initialized()  # the session's cluster itself goes on
