"""What every `raylane` command shares: the console, the common options, logging, and how a
mistake in its arguments or config ends it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from raylane.config import ConfigError, RaylaneConfig, load_config

DEFAULT_CONFIG = Path("configs/train/digits_ddp.yaml")

console = Console(stderr=True)


def _config_option(help: str):
    """The `--config/-c` option, its help saying what this command reads."""
    return Annotated[Path, typer.Option("--config", "-c", help=help)]


ConfigOption = _config_option("Run config YAML (see configs/).")
SpecOption = _config_option("Search spec YAML (see configs/tune/).")
FinetuneConfigOption = _config_option("A config with a `finetune:` section.")


def _set_option(example: str):
    """The repeatable `--set KEY.PATH=VALUE` option, its help showing a key of this command."""
    return Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help=f"Override a field: --set {example} (repeatable)."),
    ]


SetOption = _set_option("training.epochs=3")  # a run config's
TuneSetOption = _set_option("trial.epochs=3")  # a search spec's
ServingSetOption = _set_option("serving.port=8001")  # a run config's, for its endpoint
PlanSetOption = _set_option("training.batch_size=512")  # a run config's, for its shape
StoreSetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a field of the config, e.g. --set tracking.tracking_uri=URI (repeatable).",
    ),
]
StoreConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Run config whose tracking store to read (default: $MLFLOW_TRACKING_URI, else "
        "sqlite:///mlflow.db).",
    ),
]
VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Stream Ray's worker, controller and Serve logs here too (otherwise they stay in "
        "Ray's log files).",
    ),
]
VersionOption = Annotated[
    int | None,
    typer.Option(
        "--version",
        min=1,
        help="Registry version to serve (default: the champion alias's). On a running app this "
        "rolls replicas onto it without dropping requests; rolling back is the same command.",
    ),
]
TrackingUriOption = Annotated[
    str | None,
    typer.Option(
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)."
    ),
]


def version_override(version: int | None) -> list[str]:
    """`--version N` as the config override it stands for."""
    return [] if version is None else [f"serving.model_version={version}"]


def setup_logging(verbose: bool = False) -> None:
    if verbose:
        os.environ["RAYLANE_VERBOSE"] = "1"
    handler = RichHandler(console=console, show_path=False, markup=False)
    logger = logging.getLogger("raylane")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    # torchao (imported for int8 weights and by PEFT) registers enums that torch 2.13 now
    # handles itself, and torch logs a deprecation warning per enum on every command; torchao
    # itself warns about the GPU kernels a CPU wheel cannot load.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("torchao").setLevel(logging.ERROR)


def fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def load(config: Path, overrides: list[str] | None) -> RaylaneConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        raise fail(str(exc)) from None
