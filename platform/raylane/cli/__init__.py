"""The `raylane` command line: prepare, train, tune, deploy, quickstart.

`app` is the Typer application; each module below adds its commands to it, in the order
`raylane --help` lists them."""

from __future__ import annotations

from importlib import import_module

from raylane.cli.common import app

for _commands in ("training", "serving", "planning", "runs"):
    import_module(f"raylane.cli.{_commands}")


def main() -> None:
    """The `raylane` command; SIGTERM stops it as Ctrl-C does, then exits 143."""
    import sys

    from raylane.cli.common import console
    from raylane.cli.stopping import EXIT_SIGTERM, stop_on_sigterm, terminated

    stop_on_sigterm()
    try:
        app()
    except SystemExit:
        if not terminated():
            raise
        console.print("stopped (SIGTERM)", highlight=False)
        sys.exit(EXIT_SIGTERM)
