"""`raylane tune`, `plan` and `profile`: choosing a layout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from raylane.cli.common import (
    DEFAULT_CONFIG,
    PlanSetOption,
    SetOption,
    SpecOption,
    TuneSetOption,
    VerboseOption,
    console,
    fail,
    load,
    setup_logging,
)
from raylane.cli.lazy import deferred
from raylane.cli.running import on_ray, user_mistakes
from raylane.models.families import shape_of
from raylane.plan.hardware import HardwareError, load_cluster
from raylane.plan.pricing import DEFAULT_RESTART_S, CostTerms, checkpoint_seconds
from raylane.plan.report import render, render_costs, render_profile, write_config
from raylane.plan.search import epoch_tokens_for, plan, plan_by_cost, workload_for
from raylane.tracking import check_tracking_reachable, resolve_tracking_uri
from raylane.tune.candidates import enumerate_candidates
from raylane.tune.spec import is_search_spec, load_spec

# Ray Tune, Ray Train and MLflow: loaded once the arguments and config are checked.
planner = deferred("raylane.tune.planner")
predicted = deferred("raylane.tune.predicted")
profile_job = deferred("raylane.profile.job")


def tune(
    config: SpecOption = Path("configs/tune/parallelism.yaml"),
    overrides: TuneSetOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Search parallelism layouts with Ray Tune on measured throughput.

    The best layout is written as a runnable config.

    Example: raylane tune --config configs/tune/parallelism.yaml -s trial.epochs=3
    """
    setup_logging(verbose)
    with user_mistakes():
        spec = load_spec(config, overrides or [])
    with on_ray():
        result = planner.plan(spec, console)
    if result.best_config is None:
        raise typer.Exit(1)


ObjectiveOption = Annotated[
    str,
    typer.Option(
        help="time: rank the whole cluster's layouts by step time. cost: rank layouts on 1 to "
        "all of its nodes by expected cost per epoch, spot (preemptions included) or on "
        "demand, from the catalog's prices."
    ),
]
EpochTokensOption = Annotated[
    float | None,
    typer.Option(
        min=1,
        help="cost: tokens per epoch, e.g. 26e9 (default: training.steps_per_epoch, or a "
        "python-stdlib source's data.max_bytes).",
    ),
]
RestartOption = Annotated[
    float | None,
    typer.Option(
        min=0,
        help="cost: seconds from a spot preemption back to training (a new node, the group's "
        "restart, the checkpoint's reload; default 300).",
    ),
]
CheckpointOption = Annotated[
    float | None,
    typer.Option(
        help="cost: seconds to write a checkpoint (default: fp32 weights and Adam state at 1 GB/s)."
    ),
]


PLAN_CONFIG = Path("configs/plan/gpt_1p3b.yaml")


def plan_layouts(
    cluster: Annotated[
        Path, typer.Option("--cluster", help="Cluster spec YAML (see configs/clusters/).")
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help=f"Training config of the GPT to plan [default: {PLAN_CONFIG}]."
        ),
    ] = None,
    overrides: PlanSetOption = None,
    model: Annotated[
        Path | None, typer.Option("--model", "-m", hidden=True, help="The same as --config.")
    ] = None,
    global_batch: Annotated[
        int | None,
        typer.Option(
            min=1, help="Sequences per step, all replicas (default: training.batch_size)."
        ),
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(help="fp32, tf32 or bf16 (default: the config's training.precision)."),
    ] = None,
    efficiency: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Share of peak FLOP/s matmuls reach.")
    ] = 0.7,
    top: Annotated[int, typer.Option(min=1, help="Layouts to show.")] = 5,
    out: Annotated[
        Path | None,
        typer.Option(help="Where to write the best layout's config (default: configs/generated/)."),
    ] = None,
    objective: ObjectiveOption = "time",
    epoch_tokens: EpochTokensOption = None,
    restart_s: RestartOption = None,
    checkpoint_s: CheckpointOption = None,
) -> None:
    """Predict the best layouts of a model on a cluster that need not exist here.

    From the model's shape and a hardware catalog: step time and memory per
    device, or with --objective cost the cost per epoch on spot or on-demand
    capacity. The winner is written as a config of what differs from the defaults.

    Example: raylane plan -c configs/plan/gpt_1p3b.yaml \\
    --cluster configs/clusters/a100_4x8.yaml --objective cost
    """
    if config is not None and model is not None:
        raise fail("give --config or --model (its old name), not both")
    config = config or model or PLAN_CONFIG
    cost_terms = (epoch_tokens, restart_s, checkpoint_s)
    _check_plan_options(precision, objective, cost_terms)
    cfg = load(config, overrides)
    cost_terms = cost_terms if objective == "cost" else None
    suffix = "cost-plan" if objective == "cost" else "plan"
    target = out or Path("configs/generated") / f"{cfg.experiment}-{suffix}.yaml"
    _plan((config, overrides or []), cfg, cluster, global_batch,
          precision or cfg.training.precision, efficiency, top, target, cost_terms)  # fmt: skip


def _check_plan_options(precision: str | None, objective: str, cost_terms: tuple) -> None:
    """One `error:` line for an option `raylane plan` cannot use."""
    if precision not in (None, "fp32", "tf32", "bf16"):
        raise fail(f"--precision must be fp32, tf32 or bf16, not {precision!r}")
    if objective not in ("time", "cost"):
        raise fail(f"--objective must be time or cost, not {objective!r}")
    if objective == "time" and any(term is not None for term in cost_terms):
        raise fail("--epoch-tokens, --restart-s and --checkpoint-s apply to --objective cost")
    checkpoint_s = cost_terms[2]
    if checkpoint_s is not None and checkpoint_s <= 0:
        raise fail(f"--checkpoint-s must be above 0, not {checkpoint_s:g}")


def _plan(
    base: tuple[Path, list[str]], cfg, cluster: Path, global_batch: int | None, precision: str,
    efficiency: float, top: int, target: Path, cost_terms: tuple | None,
) -> None:  # fmt: skip
    """Plan, print and write; `base` is the config and its `--set`s, `cost_terms` (epoch
    tokens, restart s, checkpoint s, each None for its default) ranks by cost instead of
    time."""
    try:
        hardware = load_cluster(cluster)
        work = workload_for(cfg, global_batch or cfg.training.batch_size, precision)
        if cost_terms is not None:
            terms, epoch_source = _resolve_cost_terms(cfg, work, *cost_terms)
            result = plan_by_cost(work, hardware, terms, efficiency)
        else:
            result = plan(work, hardware, efficiency)
    except (HardwareError, ValueError) as exc:
        raise fail(str(exc)) from None
    if not result.ranked:
        raise fail(
            f"no layout of {work.shape.total() / 1e9:.2f} B parameters fits {hardware.devices} "
            f"x {hardware.spec.accelerator} ({len(result.pruned)} pruned by memory)",
            code=1,
        )
    out_console = Console()
    if cost_terms is not None:
        render_costs(result, hardware, efficiency, out_console, top, epoch_source)
    else:
        render(result, hardware, efficiency, out_console, top)
    written = write_config(base[0], result, target, base[1])
    out_console.print(f"config: {written}", highlight=False)


def _resolve_cost_terms(cfg, work, epoch_tokens, restart_s, checkpoint_s) -> tuple:
    """The cost terms with each default filled in, and where the epoch's size comes from."""
    if epoch_tokens is None:
        epoch_tokens, epoch_source = epoch_tokens_for(cfg, work)
    else:
        epoch_source = "--epoch-tokens"
    if checkpoint_s is None:
        checkpoint_s = checkpoint_seconds(work.shape.total())
    restart_s = DEFAULT_RESTART_S if restart_s is None else restart_s
    return CostTerms(epoch_tokens, checkpoint_s, restart_s), epoch_source


def profile_cluster(
    config: Annotated[
        Path,
        typer.Option(
            "--config",
            "-c",
            help="Training config YAML, or a search spec (configs/tune/): then what the search "
            "profiles.",
        ),
    ] = DEFAULT_CONFIG,
    overrides: SetOption = None,
    refresh: Annotated[
        bool, typer.Option(help="Measure again even if this model and cluster were profiled.")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Measure what the config's GPT blocks and the worker group's links cost.

    A short Ray Train job; the profile is logged to MLflow and reused while model
    and cluster are unchanged.

    Example: raylane profile --config configs/train/lm_pipeline.yaml
    """
    setup_logging(verbose)
    cfg, levels, tracking_uri = _what_to_profile(config, overrides)
    try:
        shape_of(cfg.model)  # a family whose blocks the profile can time
    except ValueError as error:
        raise fail(str(error)) from None
    tracking_uri = resolve_tracking_uri(tracking_uri)
    with user_mistakes():
        check_tracking_reachable(tracking_uri)
    with on_ray():
        found, run_id, reused = profile_job.load_or_measure(
            cfg, tracking_uri, refresh, concurrency=levels
        )
    out = Console()
    render_profile(found, reused, out)
    out.print(f"MLflow run {run_id}", highlight=False)


def _what_to_profile(config: Path, overrides: list[str] | None):
    """A training config at its own worker count, or a search spec's widest layout at each of
    its worker counts (the profile `raylane tune` measures, so the search then reuses it)."""
    if not is_search_spec(config):
        cfg = load(config, overrides)
        return cfg, None, cfg.tracking.tracking_uri
    with user_mistakes():
        spec = load_spec(config, overrides or [])
        candidates, _ = enumerate_candidates(spec)
        if not candidates:
            raise fail(f"{config}: no valid layout to profile")
        return (*predicted.profile_input(spec, candidates), spec.tracking_uri)
