"""`raylane quickstart`: the whole path once, from data to a queried endpoint."""

from __future__ import annotations

from typing import Annotated

import typer

from raylane.cli.common import (
    DEFAULT_CONFIG,
    ConfigOption,
    SetOption,
    VerboseOption,
    console,
    load,
    setup_logging,
)
from raylane.cli.lazy import deferred
from raylane.cli.running import user_mistakes

# Ray, Ray Serve, MLflow and torch: loaded once the config is checked.
pipeline = deferred("raylane.quickstart")


def quickstart(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: SetOption = None,
    requests: Annotated[int, typer.Option(min=1, max=100, help="Rows to send.")] = 10,
    verbose: VerboseOption = False,
) -> None:
    """Prepare, train (DDP), register, deploy, query over HTTP, shut down.

    Example: raylane quickstart --requests 20
    """
    setup_logging(verbose)
    cfg = load(config, overrides)
    with user_mistakes():
        pipeline.run_quickstart(cfg, rows=requests, console=console)
