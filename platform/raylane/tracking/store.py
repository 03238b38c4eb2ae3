"""Which MLflow tracking store a run uses, and whether it can be reached."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message names the URI."""


def resolve_tracking_uri(configured: str | None = None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI, else `sqlite:///mlflow.db`.

    Relative SQLite and file paths are made absolute: Ray workers and Serve replicas run in other
    working directories and must still write to the same store.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    if uri.startswith("file:") or "://" not in uri:
        return Path(uri.removeprefix("file:")).resolve().as_uri()
    return uri


def check_tracking_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any compute is spent, when a tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        response = requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except requests.RequestException as exc:
        raise TrackingError(
            f"MLflow tracking server {uri} is unreachable ({type(exc).__name__})"
        ) from None
    if response.status_code >= 500:
        raise TrackingError(f"MLflow tracking server {uri} answered {response.status_code}")
