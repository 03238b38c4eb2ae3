"""Connecting to Ray: an address from $RAY_ADDRESS (a cluster) or a local Ray started here; and
the torch threads each worker on a node gets (`worker_threads`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from raylane.console import long_step

if TYPE_CHECKING:
    from raylane.config import RaylaneConfig

log = logging.getLogger("raylane")


def verbose() -> bool:
    """Whether Ray's worker logs stream to this console (`--verbose`, or RAYLANE_VERBOSE=1)."""
    return os.environ.get("RAYLANE_VERBOSE") == "1"


#: Set by Ray in the driver of a `ray job submit` job (its runtime env, working dir included).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def connect_ray(
    address: str | None = None,
    before_local_start: Callable[[], None] | None = None,
    ship: Path | None = None,
) -> bool:
    """Connect to the cluster at `address` / $RAY_ADDRESS, else start a local Ray.

    Returns True when this call started Ray (the caller then owns `ray.shutdown()`).
    `before_local_start` runs only when a Ray is started here, before it starts (serving sets
    Serve's ingress variables with it: a running cluster keeps what it was started with).
    `ship` (a package directory or module file of the working directory, such as a custom
    model's factory) goes to every node of a running cluster as a Ray `py_modules` runtime
    env: Ray hands workers the driver's working directory as a path, which exists on other
    nodes only with shared storage. Not sent to a local Ray, nor from inside a `ray job
    submit` job (its `--working-dir`, when given, is what Ray ships).
    Ray 2.60 turns token authentication on for local clusters: a local start writes
    ~/.ray/auth_token, and clients of a `ray start` cluster need RAY_AUTH_MODE=token and that
    token (see docs/guides/clusters.md). Inside a `ray job submit` job, RAY_ADDRESS is set by
    Ray itself.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address is None and before_local_start is not None:
        before_local_start()
    # "local" always starts a new Ray for this process, even when another one (say a
    # `ray start` cluster of someone else's) runs on the machine.
    runtime_env = None
    if ship is not None and address is not None and JOB_CONFIG_ENV not in os.environ:
        runtime_env = {"py_modules": [str(ship)]}
    if address is None:  # what `disconnect_ray` may wait for and stop: what this start adds
        _BEFORE_LOCAL_RAY.clear()
        _BEFORE_LOCAL_RAY.update(_descendants())
    with long_step("connecting to Ray" if address else "starting Ray"), _sigterm_kept():
        context = ray.init(
            address=address or "local",
            logging_level=logging.WARNING,
            log_to_driver=verbose(),
            runtime_env=runtime_env,
        )
    if not verbose():
        logs = Path(context.address_info.get("session_dir", "/tmp/ray/session_latest")) / "logs"
        logging.getLogger("raylane").info("Ray's logs: %s (--verbose shows them here)", logs)
    return address is None


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """Whatever handled SIGTERM before `ray.init` still does after it. Ray installs its own
    handler (a C++ stack dump, then exit: a `raylane deploy` stopped so left Serve's HAProxy
    and Ray's agents running); the command line's handler stops a command as Ctrl-C does
    (`raylane.cli.stopping`)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


#: The processes this one had started before it started a local Ray (`connect_ray`): not
#: Ray's, so `disconnect_ray` leaves them alone.
_BEFORE_LOCAL_RAY: set[int] = set()


def _descendants() -> set[int]:
    import psutil

    return {process.pid for process in psutil.Process().children(recursive=True)}


#: How long stopping a Ray this process started waits for its processes (raylet, GCS, the
#: dashboard, workers) to exit before killing the rest.
STOP_WAIT_S = 15.0


def disconnect_ray(started_here: bool) -> None:
    """Disconnect; a Ray this process started is stopped and the processes started with it
    waited for (killed past `STOP_WAIT_S`), so that the command returns with nothing of it
    running (a next command can bind its ports)."""
    import psutil
    import ray

    if not (started_here and ray.is_initialized()):
        return
    spawned = [
        p for p in psutil.Process().children(recursive=True) if p.pid not in _BEFORE_LOCAL_RAY
    ]
    ray.shutdown(wait_for_processes=True)
    _, alive = psutil.wait_procs(spawned, timeout=STOP_WAIT_S)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=STOP_WAIT_S)


def worker_threads(cfg: RaylaneConfig, local_world_size: int) -> int:
    """torch threads for one worker: the node's cores shared by the workers on it."""
    if cfg.parallelism.torch_threads:
        return cfg.parallelism.torch_threads
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


#: glibc's mallopt parameter: blocks at least this large are mapped on their own and unmapped
#: when freed (setting it also stops glibc raising the threshold as the process frees blocks).
_M_MMAP_THRESHOLD = -3
#: `training.host_memory: lean`'s threshold: 1 MB (a 0.5B LoRA step with an fp32 base held
#: 2.8 GB at its peak with it, 2.75 GB with 128 KB, 5.0 GB with glibc's default).
LEAN_MMAP_BYTES = 1 << 20


def apply_host_memory(mode: str) -> bool:
    """`training.host_memory` in this process: 'lean' maps every block of `LEAN_MMAP_BYTES` or
    more on its own, so freeing it gives it back to the system. False (said in one line) where
    the C library has no mallopt (not glibc): the default allocator then keeps freed pages."""
    if mode != "lean":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        log.warning("training.host_memory 'lean' needs glibc's mallopt, which this system lacks")
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, LEAN_MMAP_BYTES))
