"""`raylane status`: what Serve runs on the cluster and which model versions answer."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlflow.tracking import MlflowClient
from rich.table import Table

from raylane.config import RaylaneConfig
from raylane.serving import APP_NAME
from raylane.tracking import resolve_tracking_uri
from raylane.tracking.registry import champion_version

SAMPLES_PER_REPLICA = 4


@dataclass
class DeploymentRow:
    app: str
    app_status: str
    deployment: str
    status: str
    replicas: dict[str, int]
    versions: set[int] = field(default_factory=set)
    settings: set[str] = field(default_factory=set)  # generation settings replicas report


@dataclass
class StatusReport:
    rows: list[DeploymentRow]
    alias: str
    alias_version: int | None


def collect_status(cfg: RaylaneConfig) -> StatusReport:
    """Serve's own status, plus the versions replicas report and where the alias points.

    Versions come from asking the model deployment several times per running replica, so
    both sides of a rollout in progress show up.
    """
    from ray import serve

    rows = []
    for app_name, app in serve.status().applications.items():
        for name, deployment in app.deployments.items():
            replicas = {
                state_name(state): count for state, count in deployment.replica_states.items()
            }
            row = DeploymentRow(
                app_name, state_name(app.status), name, state_name(deployment.status), replicas
            )
            running = replicas.get("RUNNING", 0)
            if app_name == APP_NAME and name in SERVED_DEPLOYMENTS and running:
                samples = _sample(name, app_name, running * SAMPLES_PER_REPLICA)
                row.versions = {stats["version"] for stats in samples}
                row.settings = {stats["settings"] for stats in samples if "settings" in stats}
            rows.append(row)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    found = champion_version(
        MlflowClient(tracking_uri=tracking_uri),
        cfg.tracking.registered_model,
        cfg.tracking.champion_alias,
    )
    return StatusReport(
        rows, cfg.tracking.champion_alias, None if found is None else int(found.version)
    )


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
        if report.alias_version and row.versions and report.alias_version not in row.versions:
            versions += " (alias moved: raylane deploy rolls onto it)"
        table.add_row(
            row.app, row.app_status, row.deployment, row.status, replicas or "0", versions
        )
    if not report.rows:
        table.add_row("-", "no Serve applications", "", "", "", "")
    return table
