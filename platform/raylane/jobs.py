"""The runtime environment a `ray job submit` of raylane needs, in one JSON argument.

A job runs in an uploaded copy of the working directory, without `.git`, on whichever Python
the cluster has: so the job is told where the MLflow store is (absolute), to import the
uploaded raylane (`PYTHONPATH=platform`, relative to each process's working directory, which
Ray sets to the upload for the driver and every worker), and which commit it was submitted
from.
"""

from __future__ import annotations

import json

from raylane.tracking import resolve_tracking_uri
from raylane.tracking.cluster import GIT_COMMIT_ENV, GIT_DIRTY_ENV, code_version


def job_runtime_env(tracking_uri: str | None = None) -> dict:
    code = code_version()
    env = {
        "MLFLOW_TRACKING_URI": resolve_tracking_uri(tracking_uri),
        "PYTHONPATH": "platform",
    }
    if code["git_commit"]:
        env[GIT_COMMIT_ENV] = code["git_commit"]
        env[GIT_DIRTY_ENV] = "1" if code["git_dirty"] else "0"
    return {"env_vars": env}


def job_runtime_env_json(tracking_uri: str | None = None) -> str:
    return json.dumps(job_runtime_env(tracking_uri))
