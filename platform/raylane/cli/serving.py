"""`raylane deploy`, `promote` and `status`: a registered model served on Ray Serve, the
version it serves, and what is running."""

from __future__ import annotations

import os
import time
from typing import Annotated

import typer
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
from raylane.config import RaylaneConfig
from raylane.serving import APP_NAME
from raylane.serving.ingress import apply_ingress_env
from raylane.serving.leftovers import clear_before_local_serve
from raylane.tracking import check_tracking_reachable, resolve_tracking_uri

# Ray Serve and MLflow: loaded once the arguments and config are checked.
registry = deferred("raylane.tracking.registry")
serve_app = deferred("raylane.serving.app")
serve_status = deferred("raylane.serving.status")


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
    cfg = load(config, [*(overrides or []), *version_override(version)])
    if detach and not _cluster_address():
        raise fail("--detach needs a running cluster (set RAY_ADDRESS); a local Ray ends with us")
    if not _cluster_address():
        with user_mistakes():
            clear_before_local_serve(cfg.serving.port)
    served = None
    with on_ray(before_local_start=lambda: apply_ingress_env(cfg.serving.ingress)) as started:
        try:
            url, served = serve_app.deploy(cfg)
            console.print(f"serving {cfg.tracking.registered_model} v{served}", highlight=False)
            _print_endpoint(cfg, url)
            if not detach:
                _block_until_interrupted()
        finally:
            began = time.monotonic()
            if not detach:
                serve_app.stop_serve(local_ray=started)
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


def promote(
    version: Annotated[int, typer.Argument(min=1, help="Registry version to give the alias.")],
    config: ConfigOption = DEFAULT_CONFIG,
    overrides: ServingSetOption = None,
) -> None:
    """Move the champion alias to VERSION; a running app (at $RAY_ADDRESS) rolls onto it."""
    setup_logging()
    cfg = load(config, overrides)
    from mlflow.tracking import MlflowClient

    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    name, alias = cfg.tracking.registered_model, cfg.tracking.champion_alias
    with user_mistakes():
        check_tracking_reachable(tracking_uri)
        registry.point_alias(
            MlflowClient(tracking_uri=tracking_uri), tracking_uri, name, alias, version
        )
    console.print(f"{name}@{alias} -> v{version}", highlight=False)
    if not _cluster_address():
        console.print("no RAY_ADDRESS: no running app to roll (the next deploy serves it)")
        return
    with on_ray():
        rolled = serve_app.roll_running_app(cfg)
    if rolled is None:
        console.print(f"no {APP_NAME!r} Serve app on the cluster: nothing to roll")
    else:
        console.print(f"{rolled[0]} now serves v{rolled[1]}", highlight=False)


def status(config: ConfigOption = DEFAULT_CONFIG, overrides: ServingSetOption = None) -> None:
    """Serve applications, deployments, replica counts and served model versions (needs
    RAY_ADDRESS: a running cluster)."""
    cfg = load(config, overrides)
    if not _cluster_address():
        raise fail("status needs a running cluster: set RAY_ADDRESS (e.g. 127.0.0.1:6379)")
    with on_ray():
        report = serve_status.collect_status(cfg)
    Console().print(serve_status.render_status(report))


def _cluster_address() -> str | None:
    return os.environ.get("RAY_ADDRESS")


def _block_until_interrupted() -> None:
    console.print("serving; press Ctrl-C to stop")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt as exc:
        console.print(f"stopping ({stopped_by(exc)})")
