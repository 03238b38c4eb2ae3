"""What every `raylane` command shares: the Typer app, the console, the common options, and
how a user's mistake or a command's time on Ray is handled."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from raylane.config import ConfigError, RaylaneConfig, load_config

DEFAULT_CONFIG = Path("configs/train/digits_ddp.yaml")

app = typer.Typer(
    help="raylane: parallel training on Ray Train, runs and models in MLflow, serving on Ray "
    "Serve.\n\nExample: raylane train --config configs/train/digits_ddp.yaml --set "
    "training.epochs=3",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def _print_version(value: bool) -> None:
    """`raylane --version`: raylane's version and those of what it runs on, without importing
    them (the installed distributions' metadata)."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    others = ", ".join(f"{name} {installed(name)}" for name in ("ray", "torch", "mlflow"))
    print(f"raylane {installed('raylane')} ({others})")
    raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="Print raylane's version, and Ray's, torch's and MLflow's, then exit.",
        ),
    ] = False,
) -> None:
    pass


ConfigOption = Annotated[
    Path, typer.Option("--config", "-c", help="Run config YAML (see configs/).")
]


def _set_option(example: str):
    """The repeatable `--set KEY.PATH=VALUE` option, its help showing a key of this command."""
    return Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help=f"Override a field: --set {example} (repeatable)."),
    ]


SetOption = _set_option("training.epochs=3")  # a run config's
TuneSetOption = _set_option("trial.epochs=3")  # a search spec's
ServingSetOption = _set_option("serving.port=8001")  # a run config's, for its endpoint
VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Stream Ray's worker, controller and Serve logs here too (otherwise they stay in "
        "Ray's log files).",
    ),
]


def setup_logging(verbose: bool = False) -> None:
    import os

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


def user_errors() -> tuple[type[Exception], ...]:
    from raylane.data import DataError
    from raylane.inference import ModelNotFoundError
    from raylane.serving.errors import ServedModelError
    from raylane.serving.guard import ApiKeyError
    from raylane.serving.leftovers import LeftoverIngressError
    from raylane.tracking import TrackingError
    from raylane.tracking.lineage import BaseModelError
    from raylane.train.job import CodeMismatchError

    return (
        ConfigError, DataError, ModelNotFoundError, TrackingError, ApiKeyError, CodeMismatchError,
        LeftoverIngressError, BaseModelError, ServedModelError,
    )  # fmt: skip


@contextmanager
def user_mistakes(*more: type[Exception]) -> Iterator[None]:
    """A user's mistake (bad config, data, store, model, key...) ends the command with one
    `error:` line naming it, not a traceback."""
    try:
        yield
    except (*user_errors(), *more) as exc:
        raise fail(str(exc)) from None


@contextmanager
def on_ray(
    *more: type[Exception], phases=None, before_local_start: Callable[[], None] | None = None
) -> Iterator[bool]:
    """One command's time on Ray: connect to $RAY_ADDRESS or start a local Ray (yielding
    whether it started one), report a user's mistake in one line, and stop a Ray it started
    however the command ends. `phases` (a PhaseClock) times the connection and shutdown."""
    from raylane.runtime import connect_ray, disconnect_ray

    def timed(name: str):
        return phases.phase(name) if phases is not None else nullcontext()

    started = False
    try:
        with user_mistakes(*more):
            with timed("ray"):
                started = connect_ray(before_local_start=before_local_start)
            yield started
    finally:
        with timed("shutdown"):
            disconnect_ray(started)


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
