"""`raylane status`: what Serve runs on the cluster and which model versions answer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from mlflow.tracking import MlflowClient
from rich.table import Table

from raylane.config import RaylaneConfig
from raylane.serving.app import serve_details
from raylane.tracking import resolve_tracking_uri
from raylane.tracking.registry import champion_version

SAMPLES_PER_REPLICA = 4
log = logging.getLogger("raylane")


@dataclass
class DeploymentRow:
    app: str
    app_status: str
    deployment: str
    status: str
    replicas: dict[str, int]
    versions: set[int] = field(default_factory=set)
    settings: set[str] = field(default_factory=set)  # generation settings replicas report
    route: str | None = None  # the application's route prefix (None: no HTTP route)


@dataclass
class StatusReport:
    rows: list[DeploymentRow]
    alias: str
    alias_version: int | None
    app: str = "raylane"  # the config's application, whose model the alias is about
    model: str = ""  # that registered model


def collect_status(cfg: RaylaneConfig) -> StatusReport:
    """Serve's own status with each application's route prefix, plus the versions every
    raylane application's replicas report and where the config's alias points.

    Versions come from asking the model deployment several times per running replica, so
    both sides of a rollout in progress show up.
    """
    from ray import serve

    routes = {
        name: app.get("route_prefix")
        for name, app in (serve_details() or {}).get("applications", {}).items()
    }
    rows = []
    for app_name, app in serve.status().applications.items():
        for name, deployment in app.deployments.items():
            replicas = {
                state_name(state): count for state, count in deployment.replica_states.items()
            }
            row = DeploymentRow(
                app_name, state_name(app.status), name, state_name(deployment.status), replicas,
                route=routes.get(app_name),
            )  # fmt: skip
            running = replicas.get("RUNNING", 0)
            if name in SERVED_DEPLOYMENTS and running:
                _read_versions(row, running, ours=app_name == cfg.serving.app_name)
            rows.append(row)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    found = champion_version(
        MlflowClient(tracking_uri=tracking_uri),
        cfg.tracking.registered_model,
        cfg.tracking.champion_alias,
    )
    return StatusReport(
        rows, cfg.tracking.champion_alias, None if found is None else int(found.version),
        cfg.serving.app_name, cfg.tracking.registered_model,
    )  # fmt: skip


def _read_versions(row: DeploymentRow, running: int, ours: bool) -> None:
    """Fill `row`'s versions and settings from its replicas' statistics. Another
    application's deployment of the same name need not be raylane's: one that cannot answer
    is shown without versions (the config's own application raises)."""
    try:
        samples = _sample(row.deployment, row.app, running * SAMPLES_PER_REPLICA)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        if ours:
            raise
        log.debug("no statistics from %s/%s: %s", row.app, row.deployment, exc)
        return
    row.versions = {stats["version"] for stats in samples}
    row.settings = {stats["settings"] for stats in samples if "settings" in stats}


SERVED_DEPLOYMENTS = ("model", "generator")  # InferenceServer, GenerationServer


def _sample(deployment: str, app_name: str, calls: int) -> list[dict]:
    """What `calls` statistics calls spread over the running replicas report.

    The calls are awaited in an event loop of their own: with Serve's throughput-optimized
    mode (the fast ingress) a handle's router runs in the caller's loop. That loop lives on in
    a thread of its own: Serve keeps the handle, and shutting Serve down later in this process
    stops the handle's router on it.
    """
    import asyncio

    from ray import serve

    async def sample() -> list[dict]:
        handle = serve.get_deployment_handle(deployment, app_name)
        return await asyncio.wait_for(
            asyncio.gather(*(handle.statistics.remote() for _ in range(calls))), timeout=30
        )

    return asyncio.run_coroutine_threadsafe(sample(), _handle_loop()).result(timeout=40)


_LOOP = None


def _handle_loop():
    global _LOOP
    if _LOOP is None:
        import asyncio
        import threading

        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="serve-handles", daemon=True).start()
    return _LOOP


def state_name(state) -> str:
    """Serve's status enums, or plain strings where it already gives those."""
    return str(getattr(state, "value", state))


def render_status(report: StatusReport) -> Table:
    alias = f"{report.alias} -> v{report.alias_version}" if report.alias_version else "unset"
    if report.model:
        alias = f"{report.model}@{alias}"
    table = Table(title=f"Serve applications (registry alias {alias})")
    for column in (
        "application",
        "status",
        "deployment",
        "deployment status",
        "replicas",
        "serving",
    ):
        table.add_column(column)
    for row in report.rows:
        replicas = ", ".join(f"{count} {state.lower()}" for state, count in row.replicas.items())
        versions = ", ".join(f"v{v}" for v in sorted(row.versions)) or "-"
        if row.settings:
            versions += " (" + "; ".join(sorted(row.settings)) + ")"
        moved = report.alias_version and report.alias_version not in row.versions
        if row.app == report.app and row.versions and moved:
            versions += " (alias moved: raylane deploy rolls onto it)"
        app = row.app if row.route in (None, "/") else f"{row.app} at {row.route}"
        table.add_row(app, row.app_status, row.deployment, row.status, replicas or "0", versions)
    if not report.rows:
        table.add_row("-", "no Serve applications", "", "", "", "")
    return table
