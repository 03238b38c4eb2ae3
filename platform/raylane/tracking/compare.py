"""What a run was, read back from MLflow alone, and how two runs (or a run and the present)
differ: config, code, data, software versions, cluster shape, final metrics and weights.

This is the first question when two runs disagree, and what `raylane reproduce` checks before
it spends compute.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from raylane.config.loader import flatten
from raylane.tracking.runs import CONFIG_ARTIFACT, SNAPSHOT_ARTIFACT

# Sections of a run record, in the order a person reads them.
SECTIONS = ("code", "data", "base", "versions", "cluster", "config", "metrics", "weights")
#: A fine-tuning run's lineage tags (`raylane.tracking.lineage`): its base, shown as `base`.
BASE_TAGS = ("raylane.base_model", "raylane.base_version", "raylane.base_digest")
FINAL_METRICS = ("train_loss", "val_loss", "val_accuracy")
# Settings that say where outputs go, not what is computed.
PLACE_KEYS = ("training.storage_path", "training.resume_from", "tracking.tracking_uri")


@dataclass(frozen=True)
class Difference:
    section: str
    key: str
    a: str
    b: str


def _artifact(client: MlflowClient, run_id: str, path: str) -> str | None:
    try:
        return Path(client.download_artifacts(run_id, path)).read_text()
    except Exception:  # MLflow raises several kinds for a missing artifact
        return None


def cluster_shape(snapshot: dict) -> dict[str, str]:
    nodes = snapshot.get("nodes", [])
    return {
        "nodes": str(len(nodes)),
        "cpus": f"{sum(n.get('cpus', 0) for n in nodes):g}",
        "gpus": f"{sum(n.get('gpus', 0) for n in nodes):g}",
    }


def run_record(client: MlflowClient, run_id: str) -> dict[str, dict[str, str]]:
    """Everything `compare` looks at, by section, as strings."""
    run = client.get_run(run_id)
    tags = run.data.tags
    snapshot = json.loads(_artifact(client, run_id, SNAPSHOT_ARTIFACT) or "{}")
    config_text = _artifact(client, run_id, CONFIG_ARTIFACT)
    config = flatten(yaml.safe_load(config_text)) if config_text else {}
    versions = snapshot.get("versions", {})
    return {
        "code": {
            "raylane.code_digest": tags.get("raylane.code_digest", "-"),
            "git commit": tags.get("mlflow.source.git.commit", "-"),
            "git dirty": tags.get("raylane.git_dirty", "-"),
        },
        "data": {"dataset digest": tags.get("raylane.dataset_digest", "-")},
        "base": {k.removeprefix("raylane."): tags[k] for k in BASE_TAGS if k in tags},
        "versions": {
            k: str(versions[k]) for k in ("python", "ray", "torch", "mlflow") if k in versions
        },
        "cluster": cluster_shape(snapshot),
        "config": {k: json.dumps(v) for k, v in config.items() if k not in PLACE_KEYS},
        "metrics": {k: repr(run.data.metrics[k]) for k in FINAL_METRICS if k in run.data.metrics},
        "weights": {"raylane.weights_digest": tags.get("raylane.weights_digest", "-")},
    }


def differences(
    a: dict[str, dict[str, str]], b: dict[str, dict[str, str]], sections=SECTIONS
) -> list[Difference]:
    found = []
    for section in sections:
        left, right = a.get(section, {}), b.get(section, {})
        for key in sorted(set(left) | set(right)):
            if left.get(key, "-") != right.get(key, "-"):
                found.append(Difference(section, key, left.get(key, "-"), right.get(key, "-")))
    return found


def metric_histories(client: MlflowClient, run_id: str) -> dict[str, list[float]]:
    """Per-epoch values of the final metrics; a replayed epoch (after a worker restart) keeps
    its last value."""
    histories = {}
    for key in FINAL_METRICS:
        by_step = {
            m.step: m.value
            for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
        }
        histories[key] = [by_step[s] for s in sorted(by_step)]
    return histories


def first_divergence(original: dict[str, list[float]], other: dict[str, list[float]]) -> str | None:
    """None when every epoch's metrics are equal; else the first epoch and metric that differ."""
    epochs = max((len(v) for v in (*original.values(), *other.values())), default=0)
    for epoch in range(epochs):
        for key in FINAL_METRICS:
            a, b = original.get(key, []), other.get(key, [])
            if epoch >= len(a) or epoch >= len(b):
                return f"epoch {epoch + 1}: {key} missing in one run"
            if a[epoch] != b[epoch] and not (math.isnan(a[epoch]) and math.isnan(b[epoch])):
                return (
                    f"epoch {epoch + 1}: {key} {a[epoch]:.6g} vs {b[epoch]:.6g} "
                    f"(difference {b[epoch] - a[epoch]:+.3g})"
                )
    return None
