"""`raylane validate`, `prepare`, `train`, `finetune`, `quickstart` and `runtime-env` (for
`ray job submit`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from raylane.cli.common import (
    DEFAULT_CONFIG,
    ConfigOption,
    SetOption,
    VerboseOption,
    app,
    console,
    fail,
    load,
    on_ray,
    setup_logging,
    user_mistakes,
)
from raylane.config import ConfigError, RaylaneConfig


@app.command()
def validate(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Check a config, or a search spec (configs/tune/), and print it fully resolved (defaults
    filled in)."""
    from raylane.config.loader import config_to_yaml
    from raylane.tune.spec import is_search_spec

    if is_search_spec(config):
        import yaml

        from raylane.tune.spec import load_spec

        try:
            spec = load_spec(config, overrides or [])
        except ConfigError as exc:
            raise fail(str(exc)) from None
        sys.stdout.write(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        return
    cfg = load(config, overrides)
    sys.stdout.write(config_to_yaml(cfg))


@app.command()
def prepare(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Materialise the config's dataset as Parquet (train and validation splits)."""
    from raylane.data import DataError, ensure_dataset

    cfg = load(config, overrides)
    try:
        train, validation = ensure_dataset(cfg)
    except DataError as exc:
        raise fail(str(exc)) from None
    console.print(f"train: {train.rows} rows at {train.path}")
    console.print(f"validation: {validation.rows} rows at {validation.path}")


@app.command()
def train(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: SetOption = None,
    resume: Annotated[
        str | None,
        typer.Option(
            metavar="RUN_ID",
            help="Continue this MLflow run from its latest checkpoint (say after the driver "
            "was killed), with the config it recorded; --config and --set are not used.",
        ),
    ] = None,
    verbose: VerboseOption = False,
) -> None:
    """Train with the config's parallelism strategy on Ray Train; track and register in MLflow."""
    setup_logging(verbose)
    cfg = _recorded(resume) if resume else load(config, overrides)
    from raylane.train.job import check_run_inputs
    from raylane.train.phases import PhaseClock

    phases = PhaseClock()
    with user_mistakes(), phases.phase("preflight"):
        check_run_inputs(cfg)  # resume checkpoint and tracking store, before Ray starts
    _train_and_report(cfg, phases, resume_run_id=resume)


def _train_and_report(cfg: RaylaneConfig, phases, report=None, **run_options) -> None:
    """Run the job on Ray (connected or started here), print its outcome (and what `report`
    prints of it), then its phases."""
    from raylane.train.job import record_phases, run_training

    with on_ray(phases=phases):
        outcome = run_training(cfg, phases=phases, **run_options)
    _print_outcome(cfg, outcome)
    if report is not None:
        report(outcome)
    record_phases(outcome, phases)
    console.print(phases.line(), highlight=False, soft_wrap=True)


@app.command()
def finetune(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="A config with a `finetune:` section.")
    ] = Path("configs/finetune/lm_lora.yaml"),
    overrides: SetOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Fine-tune a registered model (LoRA or every weight) on Ray Train; register the result
    against its base."""
    setup_logging(verbose)
    cfg = load(config, overrides)
    if cfg.finetune is None:
        raise fail(f"{config}: no finetune: section (raylane train trains from scratch)")
    from raylane.tracking import resolve_tracking_uri
    from raylane.tracking.lineage import resolve_base
    from raylane.train.job import check_run_inputs
    from raylane.train.phases import PhaseClock

    phases = PhaseClock()
    with user_mistakes(), phases.phase("preflight"):
        check_run_inputs(cfg)  # the tracking store and the base, before Ray starts
        with console.status(f"loading the base model {cfg.finetune.base}"):
            base = resolve_base(cfg, resolve_tracking_uri(cfg.tracking.tracking_uri))
    console.print(
        f"base: {base.name} v{base.version} (weights {base.digest[:12]}), "
        f"method {cfg.finetune.method}",
        highlight=False,
    )
    _train_and_report(cfg, phases, report=lambda o: _print_base_against(cfg, o), base=base)


def _print_base_against(cfg: RaylaneConfig, outcome) -> None:
    """The base's validation loss on the new domain next to the fine-tuned model's."""
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(outcome.tracking_uri).get_run(outcome.run_id).data.metrics
    before = metrics.get("base_val_loss")  # not logged when the run resumed mid-way
    shown = "n/a" if before is None else f"{before:.4f}"
    after = outcome.metrics["val_loss"]
    console.print(
        f"val_loss on {cfg.data.source}: base {shown}, fine-tuned {after:.4f}", highlight=False
    )


def _recorded(run_id: str) -> RaylaneConfig:
    """The config a run recorded (for --resume), read from its MLflow record."""
    from mlflow.tracking import MlflowClient

    from raylane.reproduce import recorded_config
    from raylane.tracking import resolve_tracking_uri

    client = MlflowClient(tracking_uri=resolve_tracking_uri(None))
    try:
        return recorded_config(client, run_id)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:  # an unknown run id, an unreachable store
        raise fail(f"run {run_id}: {str(exc).splitlines()[0]}") from None


def _print_outcome(cfg: RaylaneConfig, outcome) -> None:
    table = Table(title=f"{cfg.experiment}: run {outcome.run_id}", show_header=False)
    for key in ("train_loss", "val_loss", "val_accuracy", "train_samples_per_s"):
        table.add_row(key, f"{outcome.metrics.get(key, float('nan')):.4f}")
    table.add_row("model", f"{cfg.tracking.registered_model} v{outcome.model_version}")
    table.add_row("registry", outcome.promotion)
    table.add_row("checkpoint", outcome.checkpoint_path)
    table.add_row("tracking", outcome.tracking_uri)
    console.print(table)


@app.command()
def quickstart(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: SetOption = None,
    requests: Annotated[int, typer.Option(min=1, max=100, help="Rows to send.")] = 10,
    verbose: VerboseOption = False,
) -> None:
    """Prepare, train (DDP), register, deploy, query the endpoint over HTTP, shut down."""
    from raylane.quickstart import run_quickstart

    setup_logging(verbose)
    cfg = load(config, overrides)
    with user_mistakes():
        run_quickstart(cfg, rows=requests, console=console)


@app.command("runtime-env")
def runtime_env(
    tracking_uri: Annotated[
        str | None,
        typer.Option(help="MLflow tracking URI for the job (default: as `raylane train` uses)."),
    ] = None,
) -> None:
    """Print the --runtime-env-json for `ray job submit` of a raylane pipeline: the tracking
    store (absolute), the uploaded raylane first on PYTHONPATH, and the git commit."""
    from raylane.jobs import job_runtime_env_json

    print(job_runtime_env_json(tracking_uri))
