"""What every benchmark shares: `--smoke`, the Ray it runs on, a free port.

`--smoke` runs a benchmark's real code path (argument parsing, imports, one tiny iteration of
each part) at the smallest sizes that still run it, in seconds, so the suite can run every
benchmark and none can break silently. Its last line is the same JSON object with the same
keys, and `"smoke": true`: smoke figures measure nothing and must never be read as
measurements. A full run's last line says `"smoke": false`.

A benchmark that needs Ray joins the cluster at $RAY_ADDRESS when it is set (clients of a
`ray start` cluster with token authentication need RAY_AUTH_MODE=token and the token, as for
any Ray client) and otherwise starts a local Ray of its own, which works with or without a
token in ~/.ray (`address="local"`: never someone else's running cluster).

Nothing here imports Ray, raylane or torch at module level: `gpu.py` runs without them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator

SMOKE_HELP = (
    "run the real code path once at toy sizes, in seconds (a check that the benchmark works; "
    'its figures measure nothing and the last line says "smoke": true)'
)


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def print_last_line(figures: dict, smoke: bool, default=None) -> None:
    """The benchmark's last line: its figures as one JSON object, marked smoke or not."""
    print(json.dumps({**figures, "smoke": smoke}, default=default), flush=True)


@contextlib.contextmanager
def ray_session(**local) -> Iterator[bool]:
    """Join the cluster at $RAY_ADDRESS, else start a local Ray with `local` (e.g.
    `num_cpus=2`); yields whether Ray was started here. Shuts down what it connected."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address:
        ray.init(address=address, **quiet)
    else:
        ray.init(address="local", **quiet, **local)
    try:
        yield not address
    finally:
        ray.shutdown()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until something listens on 127.0.0.1:`port`; fails when `server` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server for port {port} exited ({server.returncode})")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listened on port {port} within {timeout_s:.0f} s")
