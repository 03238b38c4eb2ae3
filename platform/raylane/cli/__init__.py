"""The `raylane` command line: prepare, train, tune, deploy, quickstart.

`COMMANDS` lists each command in the order `raylane --help` shows them, with the function that
runs it and its one-line help: `raylane --help` reads only this list, and a command's module
is imported when that command runs or shows its own --help (`raylane.cli.lazy`)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Annotated

import typer

from raylane.cli.lazy import Listed, lazy_group
from raylane.cli.stopping import EXIT_SIGTERM, stop_on_sigterm, terminated

COMMANDS = (
    Listed("validate", "raylane.cli.validate:validate",
           "Check a config, or a search spec (configs/tune/), and print it fully resolved "
           "(defaults filled in)."),
    Listed("prepare", "raylane.cli.prepare:prepare",
           "Materialise the config's dataset as Parquet (train and validation splits)."),
    Listed("train", "raylane.cli.training:train",
           "Train with the config's parallelism strategy on Ray Train; track and register in "
           "MLflow."),
    Listed("finetune", "raylane.cli.training:finetune",
           "Fine-tune a registered model (LoRA or every weight) on Ray Train; register the "
           "result against its base."),
    Listed("quickstart", "raylane.cli.quickstart:quickstart",
           "Prepare, train (DDP), register, deploy, query the endpoint over HTTP, shut down."),
    Listed("runtime-env", "raylane.cli.env:runtime_env",
           "Print the --runtime-env-json for `ray job submit` of a raylane pipeline: the "
           "tracking store (absolute), the uploaded raylane first on PYTHONPATH, and the git "
           "commit."),
    Listed("serve-env", "raylane.cli.env:serve_env",
           "Print the `export` line that selects Serve's ingress for a Ray started after it: "
           'eval "$(raylane serve-env)" before `ray start` or `serve run`.'),
    Listed("deploy", "raylane.cli.serving:deploy",
           "Serve a registered model (blocks until Ctrl-C): Open Inference Protocol infer, or "
           "text generation over an OpenAI-compatible API with `serving.api: generate`."),
    Listed("generate", "raylane.cli.generate:generate",
           "Generate text from a registered language model here, with its KV cache, printing "
           "it as it comes (no cluster needed). Example: raylane generate --prompt 'def main('"),
    Listed("promote", "raylane.cli.serving:promote",
           "Move the champion alias to VERSION; a running app (at $RAY_ADDRESS) rolls onto "
           "it."),
    Listed("status", "raylane.cli.serving:status",
           "Serve applications, deployments, replica counts and served model versions (needs "
           "RAY_ADDRESS: a running cluster)."),
    Listed("tune", "raylane.cli.planning:tune",
           "Search parallelism layouts with Ray Tune on measured throughput; emit the best "
           "config."),
    Listed("plan", "raylane.cli.planning:plan_layouts",
           "Predict the best layouts of a model on a cluster that need not exist here (step "
           "time, memory per device; with --objective cost, cost per epoch on spot or "
           "on-demand capacity), from its shape and a hardware catalog; write the winner's "
           "config."),
    Listed("profile", "raylane.cli.planning:profile_cluster",
           "Measure what the config's GPT blocks and the worker group's links cost (a short "
           "Ray Train job); log it to MLflow and reuse it while model and cluster are "
           "unchanged."),
    Listed("compare", "raylane.cli.runs:compare",
           "What differs between two training runs: code, data, versions, cluster, config "
           "keys, final metrics and weights."),
    Listed("reproduce", "raylane.cli.runs:reproduce",
           "Re-run a training run from MLflow alone and say whether it came out identical."),
    Listed("import", "raylane.cli.models:import_",
           "Register a Hugging Face checkpoint (Llama, Mistral, Qwen2) as a new model "
           "version."),
    Listed("export", "raylane.cli.models:export",
           "Write a registered Llama-family model (imported, or trained by raylane) as a "
           "Hugging Face directory."),
)  # fmt: skip

app = typer.Typer(
    cls=lazy_group(*COMMANDS),
    help="raylane: parallel training on Ray Train, runs and models in MLflow, serving on Ray "
    "Serve.\n\nExample: raylane train --config configs/train/digits_ddp.yaml --set "
    "training.epochs=3",
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
