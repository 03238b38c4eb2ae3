"""Build and run the Serve application from a validated config."""

from __future__ import annotations

import logging
import time
from typing import Any

from mlflow.tracking import MlflowClient
from ray.serve.config import BackpressureConfig
from ray.serve.schema import LoggingConfig

from raylane.config import RaylaneConfig, load_config
from raylane.config.model_uri import parse_model_uri
from raylane.console import long_step
from raylane.serving import APP_NAME
from raylane.serving.deployments import InferenceServer
from raylane.serving.errors import ServedModelError
from raylane.serving.guard import key_digest, load_api_key
from raylane.serving.replica import ReplicaSetup
from raylane.tracking import check_tracking_reachable, resolve_tracking_uri
from raylane.tracking.lineage import ADAPTER_TAG, recorded_shape
from raylane.tracking.registry import resolve_version

log = logging.getLogger("raylane")

DEFAULT_CONFIG = "configs/train/digits_ddp.yaml"


def build_app(cfg: RaylaneConfig, tracking_uri: str, version: int, api_key: str | None):
    """The model deployment serving registry `version`, configured from `cfg.serving`:
    `InferenceServer` (OIP infer) or, with `serving.api: generate`, `GenerationServer`.

    `api_key` (`load_api_key_for`, read on the deploying side) reaches replicas only as its
    digest. Replicas ask Ray for `serving.replica_gpus` GPUs and compute on them when above 0.
    """
    serving = cfg.serving
    scaling = serving.autoscaling
    threads = max(1, int(serving.replica_cpus))
    replica = ReplicaSetup(
        tracking_uri, cfg.tracking.registered_model, version, serving.model_name,
        key_digest(api_key), serving.max_body_bytes, threads, serving.replica_gpus,
    )  # fmt: skip
    if serving.api == "generate":
        # torch-heavy: replicas run the model; the deploying process needs only the class
        from raylane.serving.generation_server import GenerationServer

        deployment, target = GenerationServer, serving.generation.max_num_seqs
        generation = serving.generation
        args = (
            replica, generation.max_num_seqs, generation.default_max_tokens,
            generation.speculate, serving.quantization, generation.draft_model,
            generation.max_adapters, generation.merge_adapter, serving.retry_after_s,
        )  # fmt: skip
        options = {"dtype": serving.dtype, "cuda_graphs": serving.cuda_graphs,
                   "max_model_len": generation.max_model_len}  # fmt: skip
    else:
        deployment, target = InferenceServer, serving.max_batch_size
        args, options = (replica, serving.max_batch_size, serving.batch_wait_timeout_s), {}
    return deployment.options(
        ray_actor_options={
            "num_cpus": serving.replica_cpus,
            "num_gpus": serving.replica_gpus,
            "resources": dict(serving.replica_resources),
        },
        max_ongoing_requests=serving.max_ongoing_requests,
        max_queued_requests=serving.max_queued_requests,
        backpressure_config=BackpressureConfig(
            status_code=503, retry_after_s=serving.retry_after_s
        ),
        max_surge_percent=serving.surge_percent,
        logging_config=LoggingConfig(
            encoding=serving.log_encoding, enable_access_log=serving.access_log
        ),
        autoscaling_config={
            "min_replicas": scaling.min_replicas,
            "initial_replicas": max(1, scaling.min_replicas),
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests or target,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
        },
    ).bind(*args, **options)


def load_api_key_for(cfg: RaylaneConfig) -> str | None:
    """The endpoint's API key per `cfg.serving` (file, then environment), or None."""
    return load_api_key(cfg.serving.api_key_env, cfg.serving.api_key_file)


def resolve_served_version(cfg: RaylaneConfig, tracking_uri: str) -> int:
    """`serving.model_version` if pinned, else the version holding the champion alias now.

    Raises:
        ModelNotFoundError: the pinned version or the alias does not exist.
    """
    found = resolve_version(
        MlflowClient(tracking_uri=tracking_uri),
        tracking_uri,
        cfg.tracking.registered_model,
        cfg.tracking.champion_alias,
        cfg.serving.model_version,
    )
    return int(found.version)


def check_served_models(cfg: RaylaneConfig, tracking_uri: str, version: int) -> None:
    """Before anything is deployed: an adapter version is served as text generation (its
    base plus the adapter), and the draft model fits (`check_draft_model`).

    Raises:
        ServedModelError: naming the version and why.
    """
    name = cfg.tracking.registered_model
    tags = MlflowClient(tracking_uri=tracking_uri).get_model_version(name, str(version)).tags
    if (tags or {}).get(ADAPTER_TAG) and cfg.serving.api != "generate":
        raise ServedModelError(
            f"{name} v{version} is a LoRA adapter: serve it with serving.api: generate (its "
            "base and the adapter are loaded together)"
        )
    check_draft_model(cfg, tracking_uri, version)


def check_draft_model(cfg: RaylaneConfig, tracking_uri: str, version: int) -> None:
    """The registry holds `serving.generation.draft_model` (when one is named), and its
    recorded architecture can propose for served `version`'s: the same vocabulary and a
    context covering the one served (`max_model_len` at most), read before anything is deployed
    from both versions' records (an import's config.json, a trained run's config, an adapter's
    base).

    Raises:
        ModelNotFoundError: naming the draft's version or alias and the store.
        ServedModelError: naming the draft and why it cannot propose for the served model.
    """
    uri = cfg.serving.generation.draft_model
    if uri is None:
        return
    # torch-heavy (the speculative decoder's module): loaded only when a draft is named
    from raylane.serving.generation.speculative import draft_mismatch

    ref = parse_model_uri(uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    found = resolve_version(client, tracking_uri, ref.name, ref.alias, ref.version)
    draft_vocab, draft_context = recorded_shape(client, found)
    served = client.get_model_version(cfg.tracking.registered_model, str(version))
    vocab, context = recorded_shape(client, served)
    # The engine serves min(the model's context, max_model_len): the draft must cover that.
    context = min(context, cfg.serving.generation.max_model_len)
    problem = draft_mismatch(vocab, context, draft_vocab, draft_context)
    if problem:
        raise ServedModelError(
            f"serving.generation.draft_model {uri} (v{found.version}) cannot draft for "
            f"{cfg.tracking.registered_model} v{version}: {problem}"
        )


def app_builder(args: dict[str, Any]):
    """Serve application builder for `serve run` / `serve deploy` config files.

    Args (from the Serve config's `args`): `config` (a raylane YAML, default
    configs/train/digits_ddp.yaml) and `overrides` (a list of `key.path=value`).
    """
    cfg = load_config(args.get("config", DEFAULT_CONFIG), list(args.get("overrides", [])))
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    version = resolve_served_version(cfg, tracking_uri)
    check_served_models(cfg, tracking_uri, version)
    return build_app(cfg, tracking_uri, version, load_api_key_for(cfg))


def endpoint_url(cfg: RaylaneConfig) -> str:
    """Where the application answers: Serve's address and `serving.route_prefix`."""
    host = "127.0.0.1" if cfg.serving.host in ("0.0.0.0", "::") else cfg.serving.host
    prefix = "" if cfg.serving.route_prefix == "/" else cfg.serving.route_prefix
    return f"http://{host}:{cfg.serving.port}{prefix}"


DEFAULT_SERVE_PORT = 8000  # Serve's HTTP port when it was started without one


class ServeConflictError(ServedModelError):
    """Serve on the cluster cannot take the application as configured: another application
    holds its route prefix, or Serve listens on another port (one line)."""


def serve_conflict(cfg: RaylaneConfig, details: dict[str, Any] | None) -> str | None:
    """Why the running Serve (`details`, as `serve_details` gives them; None when Serve is not
    running) cannot take `cfg`'s application, or None. Its own application may be redeployed
    at any prefix; an application being deleted frees its prefix, as Serve counts it."""
    if details is None:
        return None
    name, prefix = cfg.serving.app_name, cfg.serving.route_prefix
    port = details.get("http_options", {}).get("port", DEFAULT_SERVE_PORT)
    if port != cfg.serving.port:
        return (
            f"Serve on this cluster listens on port {port}, not serving.port {cfg.serving.port}: "
            f"its applications share that port (--set serving.port={port})"
        )
    for other, app in details.get("applications", {}).items():
        if other != name and app.get("route_prefix") == prefix and app.get("status") != "DELETING":
            return (
                f"serving.route_prefix {prefix!r} is held by the running Serve application "
                f"{other!r}: give application {name!r} a prefix of its own (e.g. --set "
                f"serving.route_prefix=/{name})"
            )
    return None


def serve_details() -> dict[str, Any] | None:
    """Serve's description of itself (applications with their route prefixes, HTTP options),
    or None when no Serve controller runs on the connected cluster."""
    # Serve's own client, as `serve.status()` reads it: that status carries no route prefixes.
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else client.get_serve_details()


def wait_until_serving(
    url: str, model_name: str, version: int, api_key: str | None = None, timeout_s: float = 180.0
) -> None:
    """Poll the model's metadata until it answers with `version` (old replicas may still
    answer for a moment while a rollout finishes)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.get(f"{url}/v2/models/{model_name}", headers=headers, timeout=10)
            if response.status_code == 200 and response.json()["versions"] == [str(version)]:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not serve version {version} within {timeout_s:.0f} s")
        time.sleep(0.5)


def deploy(cfg: RaylaneConfig) -> tuple[str, int]:
    """Deploy (or roll the running app onto) the chosen version as Serve application
    `serving.app_name` at `serving.route_prefix`; wait until it answers. Other applications on
    the cluster keep running.

    With the app already running, Serve starts replicas of the new version, moves traffic to
    them once they are ready and drains the old ones: requests keep being answered throughout.
    Returns the endpoint URL and the version deployed.

    Raises:
        ModelNotFoundError: the pinned version, the champion alias or the draft model does
            not exist (checked before anything is deployed).
        ServedModelError: an adapter served as infer, or a draft that cannot propose.
        ServeConflictError: another application holds the route prefix, or Serve runs on
            another port.
        ApiKeyError: `serving.api_key_file` is set but unreadable or empty.
    """
    from ray import serve

    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    check_tracking_reachable(tracking_uri)
    version = resolve_served_version(cfg, tracking_uri)
    check_served_models(cfg, tracking_uri, version)
    api_key = load_api_key_for(cfg)
    app = build_app(cfg, tracking_uri, version, api_key)
    conflict = serve_conflict(cfg, serve_details())
    if conflict:
        raise ServeConflictError(conflict)
    serve.start(http_options={"host": cfg.serving.host, "port": cfg.serving.port})
    with long_step(f"starting replicas of {cfg.tracking.registered_model} v{version}"):
        name, prefix = cfg.serving.app_name, cfg.serving.route_prefix
        serve.run(app, name=name, route_prefix=prefix, blocking=False)
        url = endpoint_url(cfg)
        wait_until_serving(url, cfg.serving.model_name, version, api_key)
    log.info("serving %s v%d at %s", cfg.tracking.registered_model, version, url)
    return url, version


def roll_running_app(cfg: RaylaneConfig) -> tuple[str, int] | None:
    """Roll the running application `serving.app_name` onto the version `cfg` picks (after
    `raylane promote`), as `deploy` does; None when it does not run on the connected cluster."""
    if cfg.serving.app_name not in running_app_names():
        return None
    return deploy(cfg)


def running_app_names() -> set[str]:
    """Serve applications on the connected cluster (empty when Serve is not running)."""
    from ray import serve

    try:
        return set(serve.status().applications)
    except Exception:  # noqa: BLE001 - no Serve controller yet means no applications
        return set()


def shutdown_serve(timeout_s: float = 120.0) -> None:
    """Shut Serve down and wait until its controller is gone.

    `serve.shutdown()` can return while the controller actor is still being killed (seen with
    the HAProxy ingress); a deploy in that window finds the dying controller and fails, so the
    next deploy on this cluster waits for it here.
    """
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    serve.shutdown()
    _wait_for_controller_exit(timeout_s)


def stop_serve(local_ray: bool, app_name: str = APP_NAME) -> None:
    """Stop serving application `app_name` before the caller disconnects. On a Ray this
    process started (`local_ray`) only that application is deleted (its replicas drain and stop
    gracefully) and Serve's controller ends with Ray: `serve.shutdown()` there has the
    controller kill itself during its own graceful-shutdown call, which Ray reports on the
    console as a failed task. On a cluster, other applications keep running
    (`undeploy`)."""
    import ray

    if not ray.is_initialized():
        return
    if local_ray:
        if app_name in running_app_names():
            _delete_app(app_name)
    else:
        undeploy(app_name)


def undeploy(app_name: str) -> bool:
    """Remove Serve application `app_name` from the connected cluster (its replicas drain and
    stop), leaving every other application serving; Serve itself is shut down
    (`shutdown_serve`) when it held no other. False when `app_name` was not running. Serve's
    state is read, never guessed: a failed read raises rather than shut other apps down."""
    details = serve_details()
    step = undeploy_step(app_name, details)
    if step == "shutdown":
        shutdown_serve()
    elif step == "delete":
        _delete_app(app_name)
    return details is not None and app_name in (details.get("applications") or {})


def undeploy_step(app_name: str, details: dict[str, Any] | None) -> str | None:
    """What removing `app_name` takes, given Serve's `details` (`serve_details`): 'shutdown'
    when Serve runs and holds no other application, 'delete' for `app_name` among others, None
    when Serve does not run or holds others but not `app_name`."""
    if details is None:
        return None
    running = set(details.get("applications") or {})
    if running <= {app_name}:
        return "shutdown"
    return "delete" if app_name in running else None


def _delete_app(app_name: str) -> None:
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the caller says what stopped
    serve.delete(app_name)


def _wait_for_controller_exit(timeout_s: float) -> None:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.5)
    log.warning("Serve's controller was still alive %.0f s after shutdown", timeout_s)
