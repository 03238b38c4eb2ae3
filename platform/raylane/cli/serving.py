"""`raylane deploy`, `promote`, `status` and `undeploy`: a registered model served on Ray
Serve, the version it serves, and what is running; `raylane generate`: text from a registered
language model, here, without a cluster."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from raylane.cli.common import (
    DEFAULT_CONFIG,
    ConfigOption,
    ServingSetOption,
    VerboseOption,
    VersionOption,
    console,
    fail,
    load,
    setup_logging,
    version_override,
)
from raylane.cli.lazy import deferred
from raylane.cli.running import on_ray, user_mistakes
from raylane.cli.stopping import stopped_by
from raylane.cli.store import open_store
from raylane.config import RaylaneConfig
from raylane.serving import APP_NAME
from raylane.serving.ingress import apply_ingress_env
from raylane.serving.leftovers import clear_before_local_serve
from raylane.tracking import resolve_tracking_uri

# Ray Serve and MLflow: loaded once the arguments and config are checked.
registry = deferred("raylane.tracking.registry")
serve_app = deferred("raylane.serving.app")
serve_status = deferred("raylane.serving.status")
# `raylane generate`: torch, the engine and the model's loader.
engine_module = deferred("raylane.serving.generation.engine")
loader = deferred("raylane.serving.generation.loader")
sampling = deferred("raylane.serving.generation.sampling")
openai_protocol = deferred("raylane.serving.openai_protocol")


def deploy(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: ServingSetOption = None,
    version: VersionOption = None,
    detach: Annotated[
        bool, typer.Option(help="Return once deployed, leaving the app on the cluster.")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Serve a registered model on Ray Serve, until Ctrl-C (or --detach).

    Open Inference Protocol infer, or text generation over an OpenAI-compatible
    API with `serving.api: generate`.

    Example: raylane deploy --config configs/train/lm_serve.yaml
    """
    setup_logging(verbose)
    cfg = load(config, [*(overrides or []), *version_override(version)])
    if detach and not _cluster_address():
        raise fail("--detach needs a running cluster (set RAY_ADDRESS); a local Ray ends with us")
    if not _cluster_address():
        with user_mistakes():
            clear_before_local_serve(cfg.serving.port)
    served = None
    with on_ray(before_local_start=lambda: apply_ingress_env(cfg.serving.ingress)) as started:
        # A deploy that fails over an application already running leaves it as it was.
        existed = not detach and cfg.serving.app_name in serve_app.running_app_names()
        try:
            url, served = serve_app.deploy(cfg)
            console.print(f"serving {cfg.tracking.registered_model} v{served}", highlight=False)
            _print_endpoint(cfg, url)
            if not detach:
                _block_until_interrupted()
        finally:
            began = time.monotonic()
            if not detach and (served is not None or not existed):
                serve_app.stop_serve(local_ray=started, app_name=cfg.serving.app_name)
    if not detach and served is not None:
        what = f"{cfg.tracking.registered_model} v{served}"
        where = "and the local Ray " if started else ""
        app = "" if cfg.serving.app_name == APP_NAME else f" {cfg.serving.app_name!r}"
        console.print(
            f"stopped: Serve app{app} ({what}) {where}in {time.monotonic() - began:.1f} s",
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


def _argument(metavar: str, help: str):
    """An optional positional argument, shown as `metavar`."""
    return typer.Argument(metavar=metavar, help=help, show_default=False)


def promote(
    model: Annotated[
        str | None,
        _argument("MODEL", "Registered model (default: the config's tracking.registered_model)."),
    ] = None,
    version: Annotated[
        str | None, _argument("VERSION", "Registry version to give the alias (required).")
    ] = None,
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: ServingSetOption = None,
) -> None:
    """Move the champion alias to VERSION of MODEL (default: the config's).

    A running app (at $RAY_ADDRESS) rolls onto it.

    Example: raylane promote raylane-digits 3
    """
    setup_logging()
    model, version = _promoted(model, version)
    cfg = load(config, overrides)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    name, alias = model or cfg.tracking.registered_model, cfg.tracking.champion_alias
    client = open_store(tracking_uri)
    with user_mistakes():
        registry.point_alias(client, tracking_uri, name, alias, version)
    console.print(f"{name}@{alias} -> v{version}", highlight=False)
    if not _cluster_address():
        console.print("no RAY_ADDRESS: no running app to roll (the next deploy serves it)")
        return
    if name != cfg.tracking.registered_model:
        console.print(
            f"{config} serves {cfg.tracking.registered_model}, not {name}: no app rolled (give "
            "--config the config it was deployed with)",
            highlight=False,
        )
        return
    with on_ray():
        rolled = serve_app.roll_running_app(cfg)
    if rolled is None:
        console.print(
            f"no {cfg.serving.app_name!r} Serve app on the cluster: nothing to roll",
            highlight=False,
        )
    else:
        console.print(f"{rolled[0]} now serves v{rolled[1]}", highlight=False)


def _promoted(first: str | None, second: str | None) -> tuple[str | None, int]:
    """`[MODEL] VERSION` as (model or None, version)."""
    if first is None:
        raise fail("promote needs VERSION, or MODEL VERSION (e.g. raylane promote 3)")
    model, version = (None, first) if second is None else (first, second)
    if not version.isdigit() or int(version) < 1:
        raise fail(f"VERSION must be a registry version (1, 2, ...), not {version!r}")
    return model, int(version)


def status(config: ConfigOption = DEFAULT_CONFIG, overrides: ServingSetOption = None) -> None:
    """Serve applications, deployments, replicas and served model versions.

    Needs a running cluster at RAY_ADDRESS.

    Example: RAY_ADDRESS=127.0.0.1:6379 raylane status
    """
    cfg = load(config, overrides)
    if not _cluster_address():
        raise fail("status needs a running cluster: set RAY_ADDRESS (e.g. 127.0.0.1:6379)")
    with on_ray():
        report = serve_status.collect_status(cfg)
    Console().print(serve_status.render_status(report))


def undeploy(config: ConfigOption = DEFAULT_CONFIG, overrides: ServingSetOption = None) -> None:
    """Remove the config's Serve application (serving.app_name) from the cluster.

    Other applications keep serving; Serve stops with the last one.
    Needs RAY_ADDRESS.

    Example: raylane undeploy --config configs/train/lm_serve.yaml
    """
    setup_logging()
    cfg = load(config, overrides)
    if not _cluster_address():
        raise fail("undeploy needs a running cluster: set RAY_ADDRESS (e.g. 127.0.0.1:6379)")
    name = cfg.serving.app_name
    with on_ray():
        removed = serve_app.undeploy(name)
    said = f"removed Serve app {name!r}" if removed else f"no {name!r} Serve app on the cluster"
    console.print(said, highlight=False)


def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue.")],
    config: ConfigOption = Path("configs/train/lm_serve.yaml"),
    overrides: ServingSetOption = None,
    version: VersionOption = None,
    max_tokens: Annotated[
        int, typer.Option(help="Tokens to generate at most (bytes for a byte-level GPT).")
    ] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k likeliest (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample within this probability mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed (repeatable output).")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop before this text.")] = None,
) -> None:
    """Generate text from a registered language model, here (no cluster needed).

    The model runs with its KV cache; the text is printed as it comes.

    Example: raylane generate --prompt 'def main('
    """
    setup_logging()
    cfg = load(config, [*(overrides or []), *version_override(version)])
    try:
        params = sampling.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop or (),
        )  # fmt: skip
    except ValidationError as exc:
        raise fail(openai_protocol.first_error(exc)) from None
    with user_mistakes(ValueError):
        tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
        served = serve_app.resolve_served_version(cfg, tracking_uri)
        model, card = loader.load_language_model(
            tracking_uri, cfg.tracking.registered_model, served
        )
        generation = cfg.serving.generation
        draft, draft_card = None, None
        if generation.draft_model is not None:
            draft, draft_card = loader.load_draft_model(tracking_uri, generation.draft_model)
        engine = engine_module.GenerationEngine(
            model, 1, speculate=generation.speculate, draft=draft, codec=card.codec,
            draft_codec=draft_card.codec if draft_card is not None else None,
            max_model_len=generation.max_model_len,
        )  # fmt: skip
        sequence = engine.add(card.codec.encode(prompt), params)
    console.print(f"{card.registered_model} v{card.version}, {card.parameters:,} parameters",
                  highlight=False)  # fmt: skip
    text = openai_protocol.TextStream()
    out = sys.stdout
    out.write(prompt)
    while not sequence.finished:
        for event in engine.step():
            out.write(text.feed(event.text, final=event.finished))
            out.flush()
    out.write("\n")
    finish = f"finish: {sequence.finish_reason}, {len(sequence.output)} tokens"
    if engine.acceptance_rate is not None:
        finish += f", {engine.acceptance_rate:.0%} of proposed tokens accepted"
    console.print(finish, highlight=False)


def _cluster_address() -> str | None:
    return os.environ.get("RAY_ADDRESS")


def _block_until_interrupted() -> None:
    console.print("serving; press Ctrl-C to stop")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt as exc:
        console.print(f"stopping ({stopped_by(exc)})")
