"""The `raylane` command line: prepare, train, tune, deploy, quickstart."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

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

ConfigOption = Annotated[
    Path, typer.Option("--config", "-c", help="Run config YAML (see configs/).")
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a field: --set training.epochs=3 (repeatable)."),
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


def _setup_logging(verbose: bool = False) -> None:
    import os

    if verbose:
        os.environ["RAYLANE_VERBOSE"] = "1"
    handler = RichHandler(console=console, show_path=False, markup=False)
    logger = logging.getLogger("raylane")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _load(config: Path, overrides: list[str] | None) -> RaylaneConfig:
    try:
        return load_config(config, overrides or [])
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _user_errors() -> tuple[type[Exception], ...]:
    from raylane.data import DataError
    from raylane.inference import ModelNotFoundError
    from raylane.serving.guard import ApiKeyError
    from raylane.serving.leftovers import LeftoverIngressError
    from raylane.tracking import TrackingError
    from raylane.train.job import CodeMismatchError

    return (
        ConfigError, DataError, ModelNotFoundError, TrackingError, ApiKeyError, CodeMismatchError,
        LeftoverIngressError,
    )  # fmt: skip


@contextmanager
def _user_mistakes(*more: type[Exception]) -> Iterator[None]:
    """A user's mistake (bad config, data, store, model, key...) ends the command with one
    `error:` line naming it, not a traceback."""
    try:
        yield
    except (*_user_errors(), *more) as exc:
        raise _fail(str(exc)) from None


@contextmanager
def _on_ray(
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
        with _user_mistakes(*more):
            with timed("ray"):
                started = connect_ray(before_local_start=before_local_start)
            yield started
    finally:
        with timed("shutdown"):
            disconnect_ray(started)


@app.command("serve-env")
def serve_env(
    ingress: Annotated[
        str, typer.Option(help="'haproxy' (raylane's default) or 'proxy' (Serve's Python proxy).")
    ] = "haproxy",
) -> None:
    """Print the `export` line that selects Serve's ingress for a Ray started after it:
    eval "$(raylane serve-env)" before `ray start` or `serve run`."""
    from raylane.serving.ingress import export_lines

    if ingress not in ("haproxy", "proxy"):
        raise _fail(f"--ingress must be 'haproxy' or 'proxy', not {ingress!r}")
    print(export_lines(ingress))


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


@app.command()
def validate(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Check a config and print it fully resolved (defaults filled in)."""
    from raylane.config.loader import config_to_yaml

    cfg = _load(config, overrides)
    sys.stdout.write(config_to_yaml(cfg))


@app.command()
def prepare(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Materialise the config's dataset as Parquet (train and validation splits)."""
    from raylane.data import DataError, ensure_dataset

    cfg = _load(config, overrides)
    try:
        train, validation = ensure_dataset(cfg)
    except DataError as exc:
        raise _fail(str(exc)) from None
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
    _setup_logging(verbose)
    cfg = _recorded(resume) if resume else _load(config, overrides)
    from raylane.train.job import check_run_inputs, record_phases, run_training
    from raylane.train.phases import PhaseClock

    phases = PhaseClock()
    with _user_mistakes(), phases.phase("preflight"):
        check_run_inputs(cfg)  # resume checkpoint and tracking store, before Ray starts
    with _on_ray(phases=phases):
        outcome = run_training(cfg, resume_run_id=resume, phases=phases)
    _print_outcome(cfg, outcome)
    record_phases(outcome, phases)
    console.print(phases.line(), highlight=False, soft_wrap=True)


def _recorded(run_id: str) -> RaylaneConfig:
    """The config a run recorded (for --resume), read from its MLflow record."""
    from mlflow.tracking import MlflowClient

    from raylane.reproduce import recorded_config
    from raylane.tracking import resolve_tracking_uri

    client = MlflowClient(tracking_uri=resolve_tracking_uri(None))
    try:
        return recorded_config(client, run_id)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    except Exception as exc:  # an unknown run id, an unreachable store
        raise _fail(f"run {run_id}: {str(exc).splitlines()[0]}") from None


def _print_outcome(cfg: RaylaneConfig, outcome) -> None:
    table = Table(title=f"{cfg.experiment}: run {outcome.run_id}", show_header=False)
    for key in ("train_loss", "val_loss", "val_accuracy", "train_samples_per_s"):
        table.add_row(key, f"{outcome.metrics.get(key, float('nan')):.4f}")
    table.add_row("model", f"{cfg.tracking.registered_model} v{outcome.model_version}")
    table.add_row("registry", outcome.promotion)
    table.add_row("checkpoint", outcome.checkpoint_path)
    table.add_row("tracking", outcome.tracking_uri)
    console.print(table)


VersionOption = Annotated[
    int | None,
    typer.Option(
        "--version",
        min=1,
        help="Registry version to serve (default: the champion alias's). On a running app this "
        "rolls replicas onto it without dropping requests; rolling back is the same command.",
    ),
]


@app.command()
def deploy(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: SetOption = None,
    version: VersionOption = None,
    detach: Annotated[
        bool, typer.Option(help="Return once deployed, leaving the app on the cluster.")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Serve a registered model (blocks until Ctrl-C): Open Inference Protocol infer, or text
    generation over an OpenAI-compatible API with `serving.api: generate`."""
    _setup_logging(verbose)
    cfg = _load(config, [*(overrides or []), *_version_override(version)])
    import time

    from raylane.serving.app import deploy as deploy_app
    from raylane.serving.app import stop_serve
    from raylane.serving.ingress import apply_ingress_env

    if detach and not _cluster_address():
        raise _fail("--detach needs a running cluster (set RAY_ADDRESS); a local Ray ends with us")
    if not _cluster_address():
        from raylane.serving.leftovers import clear_before_local_serve

        with _user_mistakes():
            clear_before_local_serve(cfg.serving.port)
    served = None
    with _on_ray(before_local_start=lambda: apply_ingress_env(cfg.serving.ingress)) as started:
        try:
            url, served = deploy_app(cfg)
            console.print(f"serving {cfg.tracking.registered_model} v{served}", highlight=False)
            _print_endpoint(cfg, url)
            if not detach:
                _block_until_interrupted()
        finally:
            began = time.monotonic()
            if not detach:
                stop_serve(local_ray=started)
    if not detach and served is not None:
        what = f"{cfg.tracking.registered_model} v{served}"
        where = "and the local Ray " if started else ""
        console.print(
            f"stopped: Serve app ({what}) {where}in {time.monotonic() - began:.1f} s",
            highlight=False,
        )


def _print_endpoint(cfg: RaylaneConfig, url: str) -> None:
    if cfg.serving.api == "generate":
        console.print(
            f"endpoint: {url}/v1 (OpenAI-compatible; model {cfg.serving.model_name!r})  "
            f"docs: {url}/docs",
            highlight=False,
        )
    else:
        console.print(f"endpoint: {url}/v2/models/{cfg.serving.model_name}/infer  docs: {url}/docs")


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue.")],
    config: ConfigOption = Path("configs/train/lm_serve.yaml"),
    overrides: SetOption = None,
    version: VersionOption = None,
    max_tokens: Annotated[int, typer.Option(help="Bytes to generate at most.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k likeliest (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample within this probability mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed (repeatable output).")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop before this text.")] = None,
) -> None:
    """Generate text from a registered language model here, with its KV cache, printing it
    as it comes (no cluster needed). Example: raylane generate --prompt 'def main('"""
    _setup_logging()
    cfg = _load(config, [*(overrides or []), *_version_override(version)])
    from pydantic import ValidationError

    from raylane.generation.engine import GenerationEngine
    from raylane.generation.loader import load_draft_model, load_language_model
    from raylane.generation.sampling import SamplingParams
    from raylane.serving.app import resolve_served_version
    from raylane.serving.openai_protocol import TextStream, first_error
    from raylane.tracking import resolve_tracking_uri

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop or (),
        )  # fmt: skip
    except ValidationError as exc:
        raise _fail(first_error(exc)) from None
    with _user_mistakes(ValueError):
        tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
        served = resolve_served_version(cfg, tracking_uri)
        model, card = load_language_model(tracking_uri, cfg.tracking.registered_model, served)
        generation = cfg.serving.generation
        draft = None
        if generation.draft_model is not None:
            draft, _ = load_draft_model(tracking_uri, generation.draft_model)
        engine = GenerationEngine(model, 1, speculate=generation.speculate, draft=draft)
        sequence = engine.add(list(prompt.encode()), params)
    console.print(f"{card.registered_model} v{card.version}, {card.parameters:,} parameters",
                  highlight=False)  # fmt: skip
    text = TextStream()
    out = sys.stdout
    out.write(prompt)
    while not sequence.finished:
        for event in engine.step():
            out.write(text.feed(event.text, final=event.finished))
            out.flush()
    out.write("\n")
    finish = f"finish: {sequence.finish_reason}, {len(sequence.output)} bytes"
    if engine.acceptance_rate is not None:
        finish += f", {engine.acceptance_rate:.0%} of proposed tokens accepted"
    console.print(finish, highlight=False)


def _version_override(version: int | None) -> list[str]:
    return [] if version is None else [f"serving.model_version={version}"]


@app.command()
def promote(
    version: Annotated[int, typer.Argument(min=1, help="Registry version to give the alias.")],
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: SetOption = None,
) -> None:
    """Move the champion alias to VERSION; a running app (at $RAY_ADDRESS) rolls onto it."""
    _setup_logging()
    cfg = _load(config, overrides)
    from mlflow.tracking import MlflowClient

    from raylane.tracking import check_tracking_reachable, resolve_tracking_uri
    from raylane.tracking.registry import point_alias

    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    name, alias = cfg.tracking.registered_model, cfg.tracking.champion_alias
    with _user_mistakes():
        check_tracking_reachable(tracking_uri)
        point_alias(MlflowClient(tracking_uri=tracking_uri), tracking_uri, name, alias, version)
    console.print(f"{name}@{alias} -> v{version}", highlight=False)
    if not _cluster_address():
        console.print("no RAY_ADDRESS: no running app to roll (the next deploy serves it)")
        return
    from raylane.serving.app import APP_NAME, roll_running_app

    with _on_ray():
        rolled = roll_running_app(cfg)
    if rolled is None:
        console.print(f"no {APP_NAME!r} Serve app on the cluster: nothing to roll")
    else:
        console.print(f"{rolled[0]} now serves v{rolled[1]}", highlight=False)


@app.command()
def status(config: ConfigOption = DEFAULT_CONFIG, overrides: SetOption = None) -> None:
    """Serve applications, deployments, replica counts and served model versions (needs
    RAY_ADDRESS: a running cluster)."""
    cfg = _load(config, overrides)
    if not _cluster_address():
        raise _fail("status needs a running cluster: set RAY_ADDRESS (e.g. 127.0.0.1:6379)")
    from raylane.serving.status import collect_status, render_status

    with _on_ray():
        report = collect_status(cfg)
    Console().print(render_status(report))


def _cluster_address() -> str | None:
    import os

    return os.environ.get("RAY_ADDRESS")


def _block_until_interrupted() -> None:
    import time

    console.print("serving; press Ctrl-C to stop")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        console.print("stopping (Ctrl-C)")


@app.command()
def tune(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Search spec YAML (see configs/tune/).")
    ] = Path("configs/tune/parallelism.yaml"),
    overrides: SetOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Search parallelism layouts with Ray Tune on measured throughput; emit the best config.

    Example: raylane tune --config configs/tune/parallelism.yaml --set trial.epochs=3
    """
    _setup_logging(verbose)
    from raylane.tune.planner import plan
    from raylane.tune.spec import load_spec

    with _user_mistakes():
        spec = load_spec(config, overrides or [])
    with _on_ray():
        result = plan(spec, console)
    if result.best_config is None:
        raise typer.Exit(1)


@app.command("plan")
def plan_layouts(
    model: Annotated[
        Path, typer.Option("--model", "-m", help="Training config of the (GPT) model to plan.")
    ],
    cluster: Annotated[
        Path, typer.Option("--cluster", help="Cluster spec YAML (see configs/clusters/).")
    ],
    global_batch: Annotated[
        int | None,
        typer.Option(
            min=1, help="Sequences per step, all replicas (default: training.batch_size)."
        ),
    ] = None,
    precision: Annotated[
        str, typer.Option(help="fp32 (what raylane trains with), tf32 or bf16.")
    ] = "fp32",
    efficiency: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Share of peak FLOP/s matmuls reach.")
    ] = 0.7,
    top: Annotated[int, typer.Option(min=1, help="Layouts to show.")] = 5,
    out: Annotated[
        Path | None,
        typer.Option(help="Where to write the best layout's config (default: configs/generated/)."),
    ] = None,
) -> None:
    """Predict the best layouts of a model on a cluster that need not exist here (step time,
    memory per device), from its shape and a hardware catalog; write the winner's config.

    Example: raylane plan --model configs/plan/gpt_1p3b.yaml \\
    --cluster configs/clusters/a100_4x8.yaml
    """
    from raylane.plan.hardware import HardwareError, load_cluster
    from raylane.plan.report import render, write_config
    from raylane.plan.search import plan, workload_for

    if precision not in ("fp32", "tf32", "bf16"):
        raise _fail(f"--precision must be fp32, tf32 or bf16, not {precision!r}")
    cfg = _load(model, None)
    try:
        hardware = load_cluster(cluster)
        work = workload_for(cfg, global_batch or cfg.training.batch_size, precision)
    except (HardwareError, ValueError) as exc:
        raise _fail(str(exc)) from None
    result = plan(work, hardware, efficiency)
    if not result.ranked:
        raise _fail(
            f"no layout of {work.shape.total() / 1e9:.2f} B parameters fits {hardware.devices} "
            f"x {hardware.spec.accelerator} ({len(result.pruned)} pruned by memory)",
            code=1,
        )
    out_console = Console()
    render(result, hardware, efficiency, out_console, top)
    target = out or Path("configs/generated") / f"{cfg.experiment}-plan.yaml"
    written = write_config(model, result, target)
    out_console.print(f"config: {written}", highlight=False)


TrackingUriOption = Annotated[
    str | None,
    typer.Option(
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)."
    ),
]


@app.command("profile")
def profile_cluster(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: SetOption = None,
    refresh: Annotated[
        bool, typer.Option(help="Measure again even if this model and cluster were profiled.")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Measure what the config's GPT blocks and the worker group's links cost (a short Ray
    Train job); log it to MLflow and reuse it while model and cluster are unchanged.

    Example: raylane profile --config configs/train/lm_pipeline.yaml
    """
    _setup_logging(verbose)
    from raylane.plan.profile_job import load_or_measure
    from raylane.tracking import check_tracking_reachable, resolve_tracking_uri

    cfg = _load(config, overrides)
    if cfg.model.kind != "gpt":
        raise _fail(f"model.kind must be 'gpt' to profile its blocks, not '{cfg.model.kind}'")
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    with _user_mistakes():
        check_tracking_reachable(tracking_uri)
    with _on_ray():
        found, run_id, reused = load_or_measure(cfg, tracking_uri, refresh)
    from raylane.plan.report import render_profile

    out = Console()
    render_profile(found, reused, out)
    out.print(f"MLflow run {run_id}", highlight=False)


@app.command()
def compare(
    run_a: Annotated[str, typer.Argument(help="MLflow run id.")],
    run_b: Annotated[str, typer.Argument(help="MLflow run id.")],
    tracking_uri: TrackingUriOption = None,
) -> None:
    """What differs between two training runs: code, data, versions, cluster, config keys,
    final metrics and weights."""
    from mlflow.tracking import MlflowClient

    from raylane.tracking import resolve_tracking_uri
    from raylane.tracking.compare import SECTIONS, differences, run_record

    client = MlflowClient(tracking_uri=resolve_tracking_uri(tracking_uri))
    try:
        records = [run_record(client, run) for run in (run_a, run_b)]
    except Exception as exc:  # an unknown run id or an unreachable store
        raise _fail(str(exc).splitlines()[0]) from None
    found = differences(*records)
    if not found:
        console.print(f"runs {run_a} and {run_b} agree in {', '.join(SECTIONS)}", highlight=False)
        return
    table = Table(title=f"{len(found)} differences")
    for name in ("section", "key", run_a[:12], run_b[:12]):
        table.add_column(name, overflow="fold")
    for item in found:
        table.add_row(item.section, item.key, item.a, item.b)
    console.print(table)


@app.command()
def reproduce(
    run_id: Annotated[str, typer.Argument(help="MLflow run id of the training run to repeat.")],
    allow_drift: Annotated[
        bool, typer.Option(help="Run even when code, data, versions or cluster differ.")
    ] = False,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Re-run a training run from MLflow alone and say whether it came out identical."""
    _setup_logging(verbose)
    if tracking_uri:
        import os

        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    from mlflow.tracking import MlflowClient

    from raylane.reproduce import DriftError
    from raylane.reproduce import reproduce as reproduce_run
    from raylane.tracking import resolve_tracking_uri

    client = MlflowClient(tracking_uri=resolve_tracking_uri(tracking_uri))
    try:
        client.get_run(run_id)
    except Exception as exc:
        raise _fail(f"run {run_id}: {str(exc).splitlines()[0]}") from None
    with _on_ray(DriftError):
        result = reproduce_run(client, run_id, allow_drift=allow_drift, show=console.print)
    console.print(
        f"{result.verdict}{': ' + result.detail if result.detail else ''} "
        f"(run {result.run_id} reproduces {run_id})",
        highlight=False,
        style="bold green" if result.verdict == "identical" else "bold red",
    )
    if result.verdict != "identical":
        raise typer.Exit(1)


@app.command()
def quickstart(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: SetOption = None,
    requests: Annotated[int, typer.Option(min=1, max=100, help="Rows to send.")] = 10,
    verbose: VerboseOption = False,
) -> None:
    """Prepare, train (DDP), register, deploy, query the endpoint over HTTP, shut down."""
    from raylane.quickstart import run_quickstart

    _setup_logging(verbose)
    cfg = _load(config, overrides)
    with _user_mistakes():
        run_quickstart(cfg, rows=requests, console=console)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
