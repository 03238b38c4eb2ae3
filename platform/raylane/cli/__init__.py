"""The `raylane` command line: data, training, planning, serving, runs and models.

`COMMANDS` lists each command in the order `raylane --help` shows them, under its help panel,
with the function that runs it and its one-line help: `raylane --help` reads only this list,
and a command's module is imported when that command runs or shows its own --help
(`raylane.cli.lazy`). `raylane util` groups the helpers; their old top-level names still work,
hidden from the listing."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import replace
from typing import Annotated

import typer

from raylane.cli.lazy import Listed, lazy_group
from raylane.cli.stopping import EXIT_SIGTERM, stop_on_sigterm, terminated

DATA, TRAINING, PLANNING, SERVING, TRACKED, UTIL = (
    "Data", "Training", "Planning", "Serving", "Runs & models", "Utilities",
)  # fmt: skip

RUNTIME_ENV = Listed(
    "runtime-env",
    "raylane.cli.env:runtime_env",
    "Print the --runtime-env-json for `ray job submit`.",
)
SERVE_ENV = Listed(
    "serve-env", "raylane.cli.env:serve_env", "Print the export line that picks Serve's ingress."
)

COMMANDS = (
    Listed("validate", "raylane.cli.validate:validate",
           "Check a run config, search spec or cluster spec.", DATA),
    Listed("prepare", "raylane.cli.prepare:prepare",
           "Materialise the config's dataset as Parquet.", DATA),
    Listed("train", "raylane.cli.training:train",
           "Train on Ray Train; track and register in MLflow.", TRAINING),
    Listed("finetune", "raylane.cli.training:finetune",
           "Fine-tune a registered model (LoRA or full) on Ray Train.", TRAINING),
    Listed("quickstart", "raylane.cli.quickstart:quickstart",
           "Prepare, train, register, deploy and query, once.", TRAINING),
    Listed("tune", "raylane.cli.planning:tune",
           "Search parallelism layouts with Ray Tune, measured.", PLANNING),
    Listed("plan", "raylane.cli.planning:plan_layouts",
           "Predict the best layouts for a cluster that need not exist.", PLANNING),
    Listed("profile", "raylane.cli.planning:profile_cluster",
           "Measure the model's blocks and the worker group's links.", PLANNING),
    Listed("deploy", "raylane.cli.serving:deploy",
           "Serve a registered model on Ray Serve.", SERVING),
    Listed("generate", "raylane.cli.serving:generate",
           "Generate text from a registered language model, here.", SERVING),
    Listed("promote", "raylane.cli.serving:promote",
           "Give a version the champion alias; a running app rolls.", SERVING),
    Listed("status", "raylane.cli.serving:status",
           "Serve apps, replicas and served versions on the cluster.", SERVING),
    Listed("undeploy", "raylane.cli.serving:undeploy",
           "Remove the config's Serve app; others keep serving.", SERVING),
    Listed("runs", "raylane.cli.browse:runs",
           "List tracked runs: status, start, strategy, metrics.", TRACKED),
    Listed("models", "raylane.cli.browse:models",
           "List registered models, their versions and aliases.", TRACKED),
    Listed("logs", "raylane.cli.browse:logs",
           "Print a run's console logs, or another text artifact.", TRACKED),
    Listed("compare", "raylane.cli.runs:compare",
           "What differs between two training runs.", TRACKED),
    Listed("reproduce", "raylane.cli.runs:reproduce",
           "Re-run a training run from MLflow; identical or not.", TRACKED),
    Listed("import", "raylane.cli.models:import_",
           "Register a Hugging Face checkpoint as a model version.", TRACKED),
    Listed("export", "raylane.cli.models:export",
           "Write a registered Llama-family model for Hugging Face.", TRACKED),
    Listed("util", "", "runtime-env, serve-env: for Ray jobs and Serve by hand.", UTIL,
           commands=(RUNTIME_ENV, SERVE_ENV)),
    replace(RUNTIME_ENV, hidden=True),  # the helpers' old names
    replace(SERVE_ENV, hidden=True),
)  # fmt: skip

app = typer.Typer(
    cls=lazy_group(*COMMANDS),
    help="raylane: parallel training on Ray Train, runs and models in MLflow, serving on Ray "
    "Serve.\n\nExample: raylane train -c configs/train/digits_ddp.yaml -s training.epochs=3",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


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


def main() -> None:
    """The `raylane` command; SIGTERM stops it as Ctrl-C does, then exits 143."""
    stop_on_sigterm()
    try:
        app()
    except SystemExit as exc:
        code = exc.code
        if terminated():
            print("stopped (SIGTERM)", file=sys.stderr, flush=True)
            code = EXIT_SIGTERM
        _exit(code)


def _exit(code) -> None:
    """Exit as the interpreter would (non-daemon threads joined, `atexit` handlers run: Ray's
    disconnect, logging's flush), without its final teardown of every module: torch, dynamo,
    MLflow, SQLAlchemy and Ray take 1.5 s or more to tear down at the end of every command."""
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
