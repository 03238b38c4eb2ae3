"""`raylane train` and `finetune`: a training job on Ray Train, tracked and registered in
MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from raylane.cli.common import (
    DEFAULT_CONFIG,
    ConfigOption,
    FinetuneConfigOption,
    SetOption,
    VerboseOption,
    console,
    fail,
    load,
    setup_logging,
)
from raylane.cli.lazy import deferred
from raylane.cli.running import on_ray, user_mistakes
from raylane.config import ConfigError, RaylaneConfig
from raylane.tracking import resolve_tracking_uri
from raylane.train.phases import PhaseClock

# Ray Train, MLflow and torch: loaded once the arguments and config are checked.
job = deferred("raylane.train.job")
preflight = deferred("raylane.train.preflight")  # pyarrow, through the data checks
lineage = deferred("raylane.tracking.lineage")
reproduce = deferred("raylane.reproduce")


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
    """Train with the config's parallelism strategy on Ray Train.

    The run is tracked in MLflow and its model registered; the champion alias
    moves to it when it scores better.

    Example: raylane train -c configs/train/digits_ddp.yaml -s training.epochs=3
    """
    setup_logging(verbose)
    cfg = _recorded(resume) if resume else load(config, overrides)
    phases = PhaseClock()
    with user_mistakes(), phases.phase("preflight"):
        preflight.check_run_inputs(cfg)  # resume checkpoint and tracking store, before Ray starts
    _train_and_report(cfg, phases, resume_run_id=resume)


def _train_and_report(cfg: RaylaneConfig, phases, report=None, **run_options) -> None:
    """Run the job on Ray (connected or started here), print its outcome (and what `report`
    prints of it), then its phases."""
    with on_ray(phases=phases, ship=cfg.model.factory_source()):
        outcome = job.run_training(cfg, phases=phases, **run_options)
    _print_outcome(cfg, outcome)
    if report is not None:
        report(outcome)
    job.record_phases(outcome, phases)
    console.print(phases.line(), highlight=False, soft_wrap=True)


def finetune(
    config: FinetuneConfigOption = Path("configs/finetune/lm_lora.yaml"),
    overrides: SetOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Fine-tune a registered model (LoRA or every weight) on Ray Train.

    The result is registered against its base, whose validation loss on the new
    data is printed beside the fine-tuned model's.

    Example: raylane finetune --config configs/finetune/lm_lora.yaml
    """
    setup_logging(verbose)
    cfg = load(config, overrides)
    if cfg.finetune is None:
        raise fail(f"{config}: no finetune: section (raylane train trains from scratch)")
    phases = PhaseClock()
    with user_mistakes(), phases.phase("preflight"):
        preflight.check_run_inputs(cfg)  # the tracking store and the base, before Ray starts
        with console.status(f"loading the base model {cfg.finetune.base}"):
            base = lineage.resolve_base(cfg, resolve_tracking_uri(cfg.tracking.tracking_uri))
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

    client = MlflowClient(tracking_uri=resolve_tracking_uri(None))
    try:
        return reproduce.recorded_config(client, run_id)
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
