"""A snapshot of the cluster a run used, so the run can be reproduced on the same shape."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import raylane
from raylane.config import RaylaneConfig


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


# A `ray job submit` working directory arrives without `.git`: the submitting side passes the
# commit in these (see docs/guides/clusters.md, its submit command).
GIT_COMMIT_ENV = "RAYLANE_GIT_COMMIT"
GIT_DIRTY_ENV = "RAYLANE_GIT_DIRTY"


def code_version() -> dict[str, Any]:
    """Git commit, dirty flag and (dirty only) the diff of the working directory; outside a
    checkout, the commit the submitter passed in $RAYLANE_GIT_COMMIT, else None."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        passed = os.environ.get(GIT_COMMIT_ENV) or None
        dirty = os.environ.get(GIT_DIRTY_ENV)
        return {
            "git_commit": passed,
            "git_dirty": None if dirty is None else dirty.strip() not in ("", "0", "false"),
            "git_source": "submitter" if passed else None,
            "git_diff": None,
        }
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": commit,
        "git_dirty": bool(status),
        "git_source": "checkout",
        "git_diff": _git("diff", "HEAD") if status else None,
    }


def package_versions() -> dict[str, str]:
    import mlflow
    import ray
    import torch

    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "mlflow": mlflow.__version__,
        "raylane": raylane.__version__,
        "platform": platform.platform(),
        "executable": sys.executable,
    }


def describe_nodes() -> list[dict[str, Any]]:
    """Every alive Ray node with its id, address and resources."""
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        nodes.append(
            {
                "node_id": node["NodeID"],
                "address": node.get("NodeManagerAddress"),
                "is_head": bool(resources.get("node:__internal_head__")),
                "cpus": resources.get("CPU", 0.0),
                "gpus": resources.get("GPU", 0.0),
                "memory_bytes": int(resources.get("memory", 0)),
                "object_store_bytes": int(resources.get("object_store_memory", 0)),
                "custom_resources": {
                    k: v
                    for k, v in resources.items()
                    if k not in {"CPU", "GPU", "memory", "object_store_memory"}
                    and not k.startswith("node:")
                },
            }
        )
    return sorted(nodes, key=lambda n: (not n["is_head"], n["node_id"]))


def snapshot_cluster(cfg: RaylaneConfig) -> dict[str, Any]:
    """Cluster shape, software versions, code version and the run's parallel layout."""
    import ray

    return {
        "captured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "cluster_resources": ray.cluster_resources(),
        "nodes": describe_nodes(),
        "versions": package_versions(),
        "code": code_version(),
        "run": {
            "seed": cfg.training.seed,
            "strategy": cfg.parallelism.strategy,
            "workers": cfg.parallelism.workers,
            "dp": cfg.parallelism.dp,
            "pp": cfg.parallelism.pp,
            "resources_per_worker": cfg.parallelism.resources_per_worker,
            "use_gpu": cfg.parallelism.use_gpu,
            "placement_strategy": cfg.parallelism.placement_strategy,
            "precision": cfg.training.precision,
            "compile": cfg.training.compile,
        },
    }
