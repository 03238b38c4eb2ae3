"""The `raylane` command line: prepare, train, tune, deploy, quickstart.

`app` is the Typer application; each module below adds its commands to it, in the order
`raylane --help` lists them."""

from __future__ import annotations

from importlib import import_module

from raylane.cli.common import app

for _commands in ("training", "serving", "planning", "runs", "models"):
    import_module(f"raylane.cli.{_commands}")


def main() -> None:
    """The `raylane` command; SIGTERM stops it as Ctrl-C does, then exits 143."""
    from raylane.cli.common import console
    from raylane.cli.stopping import EXIT_SIGTERM, stop_on_sigterm, terminated

    stop_on_sigterm()
    try:
        app()
    except SystemExit as exc:
        code = exc.code
        if terminated():
            console.print("stopped (SIGTERM)", highlight=False)
            code = EXIT_SIGTERM
        _exit(code)


def _exit(code) -> None:
    """Exit as the interpreter would (non-daemon threads joined, `atexit` handlers run: Ray's
    disconnect, logging's flush), without its final teardown of every module: torch, dynamo,
    MLflow, SQLAlchemy and Ray take 1.5 s or more to tear down at the end of every command."""
    import atexit
    import os
    import sys
    import threading

    threading._shutdown()  # as the interpreter does first: thread pools told to end, joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code)
