"""Build and run the Serve application from a validated config."""

from __future__ import annotations

import logging
import time
from typing import Any

from raylane.config import RaylaneConfig, load_config
from raylane.serving.deployments import InferenceAPI, ModelReplica

log = logging.getLogger("raylane")

APP_NAME = "raylane"
DEFAULT_CONFIG = "configs/train/digits_ddp.yaml"


def build_app(cfg: RaylaneConfig, tracking_uri: str):
    """Ingress -> batched model deployment, with batching and autoscaling from `cfg.serving`."""
    serving = cfg.serving
    scaling = serving.autoscaling
    model = ModelReplica.options(
        ray_actor_options={
            "num_cpus": serving.replica_cpus,
            "resources": dict(serving.replica_resources),
        },
        max_ongoing_requests=serving.max_ongoing_requests,
        autoscaling_config={
            "min_replicas": scaling.min_replicas,
            "initial_replicas": max(1, scaling.min_replicas),
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
        },
    ).bind(
        tracking_uri,
        cfg.tracking.registered_model,
        cfg.tracking.champion_alias,
        serving.max_batch_size,
        serving.batch_wait_timeout_s,
        max(1, int(serving.replica_cpus)),
    )
    return InferenceAPI.options(ray_actor_options={"num_cpus": 0.1}).bind(model, serving.model_name)


def app_builder(args: dict[str, Any]):
    """Serve application builder for `serve run` / `serve deploy` config files.

    Args (from the Serve config's `args`): `config` (a raylane YAML, default
    configs/train/digits_ddp.yaml) and `overrides` (a list of `key.path=value`).
    """
    from raylane.tracking import resolve_tracking_uri

    cfg = load_config(args.get("config", DEFAULT_CONFIG), list(args.get("overrides", [])))
    return build_app(cfg, resolve_tracking_uri(cfg.tracking.tracking_uri))


def endpoint_url(cfg: RaylaneConfig) -> str:
    host = "127.0.0.1" if cfg.serving.host in ("0.0.0.0", "::") else cfg.serving.host
    return f"http://{host}:{cfg.serving.port}"


def wait_until_ready(url: str, timeout_s: float = 120.0) -> None:
    """Poll the readiness route until the model replica answers."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become ready within {timeout_s:.0f} s")
        time.sleep(0.5)


def deploy(cfg: RaylaneConfig) -> str:
    """Start Serve on the connected cluster, deploy the champion, wait until it answers.

    Raises:
        ModelNotFoundError: no version holds the champion alias (checked before deploying).
    """
    from mlflow.tracking import MlflowClient
    from ray import serve

    from raylane.inference import ModelNotFoundError
    from raylane.tracking import check_tracking_reachable, resolve_tracking_uri
    from raylane.tracking.registry import champion_version

    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    check_tracking_reachable(tracking_uri)
    name, alias = cfg.tracking.registered_model, cfg.tracking.champion_alias
    if champion_version(MlflowClient(tracking_uri=tracking_uri), name, alias) is None:
        raise ModelNotFoundError(
            f"no version of registered model {name!r} has alias {alias!r} in {tracking_uri}; "
            "train one first (raylane train)"
        )
    serve.start(http_options={"host": cfg.serving.host, "port": cfg.serving.port})
    serve.run(build_app(cfg, tracking_uri), name=APP_NAME, route_prefix="/", blocking=False)
    url = endpoint_url(cfg)
    wait_until_ready(url)
    log.info("serving %s@%s at %s", name, alias, url)
    return url
