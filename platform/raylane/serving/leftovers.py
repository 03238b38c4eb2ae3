"""Serve's HAProxy left behind by a Ray that is gone.

Serve's HAProxy ingress runs the `haproxy` binary as a child of a Serve actor. When the process
that started a local Ray is killed outright (SIGKILL, an out-of-memory kill), Ray's processes
go but that child can stay, still listening on the endpoint's port (and HAProxy's stats and
metrics ports), and the next Serve start fails with "Address already in use". Before starting
a local Ray, `raylane deploy` and the quickstart look for such a process of their own user:
an HAProxy running Serve's configuration whose parent is no longer a Ray process, listening on
a port they need.
"""

from __future__ import annotations

import os

SERVE_CONFIG_MARK = "haproxy-serve"  # Serve's config directory (/tmp/haproxy-serve/...)


class LeftoverIngressError(RuntimeError):
    """A leftover HAProxy holds a needed port and could not be stopped; the message says how."""


def leftover_ingress(ports: set[int] | None) -> list[tuple[object, list[int]]]:
    """`(process, ports it holds)` for each orphaned Serve HAProxy listening on `ports` (on
    any port when None)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["name", "cmdline", "uids"]):
        try:
            command = proc.info["cmdline"] or []
            if "haproxy" not in (proc.info["name"] or "") or not any(
                SERVE_CONFIG_MARK in part for part in command
            ):
                continue
            if proc.info["uids"] is not None and proc.info["uids"].real != os.getuid():
                continue
            if _started_by_a_live_ray(proc):
                continue
            held = sorted(
                c.laddr.port
                for c in proc.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and (ports is None or c.laddr.port in ports)
            )
        except psutil.Error:
            continue
        if held:
            found.append((proc, held))
    return found


def _started_by_a_live_ray(proc) -> bool:
    """Whether `proc`'s parent is a Ray worker (its title is `ray::<actor>`)."""
    parent = proc.parent()
    if parent is None or parent.pid == 1:
        return False
    title = parent.cmdline()[:1] or [""]
    return parent.name().startswith("ray::") or title[0].startswith("ray::")


def stop_leftover_ingress(ports: set[int] | None, timeout_s: float = 5.0) -> list[str]:
    """Stop each leftover HAProxy holding one of `ports`; one line per process stopped.

    Raises:
        LeftoverIngressError: a leftover did not stop (the message names its pid and ports).
    """
    import psutil

    stopped = []
    for proc, held in leftover_ingress(ports):
        try:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        except psutil.NoSuchProcess:
            pass
        except psutil.Error as exc:
            raise LeftoverIngressError(
                f"a leftover Serve HAProxy (pid {proc.pid}) holds port(s) "
                f"{', '.join(map(str, held))} and could not be stopped ({exc}): "
                f"stop it with `kill {proc.pid}`"
            ) from None
        ports_text = ", ".join(map(str, held))
        stopped.append(
            f"stopped a leftover Serve HAProxy (pid {proc.pid}, port {ports_text}) of a Ray "
            "that is gone"
        )
    return stopped


def ingress_ports(serving_port: int) -> set[int]:
    """The endpoint's port and HAProxy's stats and metrics ports (Serve's defaults unless
    set in the environment)."""
    return {
        serving_port,
        int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", 8404)),
        int(os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT", 9101)),
    }


def clear_before_local_serve(serving_port: int) -> None:
    """Before a Ray is started here to serve: stop leftover HAProxies on the ports it needs,
    saying so on the console (`raylane` logger).

    Raises:
        LeftoverIngressError: one could not be stopped.
    """
    import logging

    for line in stop_leftover_ingress(ingress_ports(serving_port)):
        logging.getLogger("raylane").warning(line)
