"""The `raylane` command line: prepare, train, tune, deploy, quickstart.

`app` is the Typer application; each module below adds its commands to it, in the order
`raylane --help` lists them."""

from __future__ import annotations

from importlib import import_module

from raylane.cli.common import app

for _commands in ("training", "serving", "planning", "runs"):
    import_module(f"raylane.cli.{_commands}")


def main() -> None:
    app()
