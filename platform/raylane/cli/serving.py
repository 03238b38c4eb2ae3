"""`raylane deploy`, `generate`, `promote`, `status` and `serve-env`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from raylane.cli.common import (
    DEFAULT_CONFIG,
    ConfigOption,
    ServingSetOption,
    VerboseOption,
    VersionOption,
    app,
    console,
    fail,
    load,
    on_ray,
    setup_logging,
    user_mistakes,
)
from raylane.config import RaylaneConfig


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
        raise fail(f"--ingress must be 'haproxy' or 'proxy', not {ingress!r}")
    print(export_lines(ingress))


@app.command()
def deploy(
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: ServingSetOption = None,
    version: VersionOption = None,
    detach: Annotated[
        bool, typer.Option(help="Return once deployed, leaving the app on the cluster.")
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Serve a registered model (blocks until Ctrl-C): Open Inference Protocol infer, or text
    generation over an OpenAI-compatible API with `serving.api: generate`."""
    setup_logging(verbose)
    cfg = load(config, [*(overrides or []), *_version_override(version)])
    import time

    from raylane.serving.app import deploy as deploy_app
    from raylane.serving.app import stop_serve
    from raylane.serving.ingress import apply_ingress_env

    if detach and not _cluster_address():
        raise fail("--detach needs a running cluster (set RAY_ADDRESS); a local Ray ends with us")
    if not _cluster_address():
        from raylane.serving.leftovers import clear_before_local_serve

        with user_mistakes():
            clear_before_local_serve(cfg.serving.port)
    served = None
    with on_ray(before_local_start=lambda: apply_ingress_env(cfg.serving.ingress)) as started:
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
    overrides: ServingSetOption = None,
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
    setup_logging()
    cfg = load(config, [*(overrides or []), *_version_override(version)])
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
        raise fail(first_error(exc)) from None
    with user_mistakes(ValueError):
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
    overrides: ServingSetOption = None,
) -> None:
    """Move the champion alias to VERSION; a running app (at $RAY_ADDRESS) rolls onto it."""
    setup_logging()
    cfg = load(config, overrides)
    from mlflow.tracking import MlflowClient

    from raylane.tracking import check_tracking_reachable, resolve_tracking_uri
    from raylane.tracking.registry import point_alias

    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    name, alias = cfg.tracking.registered_model, cfg.tracking.champion_alias
    with user_mistakes():
        check_tracking_reachable(tracking_uri)
        point_alias(MlflowClient(tracking_uri=tracking_uri), tracking_uri, name, alias, version)
    console.print(f"{name}@{alias} -> v{version}", highlight=False)
    if not _cluster_address():
        console.print("no RAY_ADDRESS: no running app to roll (the next deploy serves it)")
        return
    from raylane.serving.app import APP_NAME, roll_running_app

    with on_ray():
        rolled = roll_running_app(cfg)
    if rolled is None:
        console.print(f"no {APP_NAME!r} Serve app on the cluster: nothing to roll")
    else:
        console.print(f"{rolled[0]} now serves v{rolled[1]}", highlight=False)


@app.command()
def status(config: ConfigOption = DEFAULT_CONFIG, overrides: ServingSetOption = None) -> None:
    """Serve applications, deployments, replica counts and served model versions (needs
    RAY_ADDRESS: a running cluster)."""
    cfg = load(config, overrides)
    if not _cluster_address():
        raise fail("status needs a running cluster: set RAY_ADDRESS (e.g. 127.0.0.1:6379)")
    from raylane.serving.status import collect_status, render_status

    with on_ray():
        report = collect_status(cfg)
    Console().print(render_status(report))


def _cluster_address() -> str | None:
    import os

    return os.environ.get("RAY_ADDRESS")


def _block_until_interrupted() -> None:
    import time

    from raylane.cli.stopping import stopped_by

    console.print("serving; press Ctrl-C to stop")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt as exc:
        console.print(f"stopping ({stopped_by(exc)})")
