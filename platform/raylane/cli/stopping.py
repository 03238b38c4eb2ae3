"""Stopping a command the same way whatever stops it: Ctrl-C, or SIGTERM (what systemd,
`docker stop`, Kubernetes and process supervisors send).

SIGTERM is turned into the exception Ctrl-C raises, in the main thread, so the same clean-up
runs (a Serve app drained and shut down, the Ray this command started stopped) and the command
ends with one line and exit status 143 (128 + 15, as a process killed by it would). `ray.init`
installs Ray's own handler (a C++ stack dump, then exit; a `raylane deploy` stopped so left
Serve's HAProxy and Ray's agents running), so `raylane.runtime.connect_ray` puts back the
handler that was there before it.
"""

from __future__ import annotations

import signal
import threading

EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_SIGINT = 128 + signal.SIGINT


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be."""


_received = threading.Event()


def _on_sigterm(signum, frame) -> None:
    if _received.is_set():
        return  # already stopping: a second SIGTERM must not cut the clean-up short
    _received.set()
    raise Terminated()


def stop_on_sigterm() -> None:
    """Route SIGTERM through Ctrl-C's path (from the main thread; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def terminated() -> bool:
    """Whether this process received SIGTERM."""
    return _received.is_set()


def stopped_by(exc: BaseException | None = None) -> str:
    """What stopped the command, for its last line."""
    return "SIGTERM" if terminated() or isinstance(exc, Terminated) else "Ctrl-C"
