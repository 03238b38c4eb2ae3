"""`raylane reproduce RUN_ID`: rebuild a run from MLflow alone, check the present matches what
it recorded, run it again and say whether it came out identical.

What is compared before running: the raylane code digest, the dataset digest, the software
versions and the cluster shape. After: every epoch's train_loss, val_loss and val_accuracy and
the digest of the final weights. What it cannot promise: kernels that are not deterministic
(many GPU ones), other hardware or BLAS builds, and data outside raylane's own digests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import yaml
from mlflow.tracking import MlflowClient
from rich.table import Table

from raylane.config import ConfigError, RaylaneConfig
from raylane.data import dataset_digest, ensure_dataset
from raylane.tracking.cluster import code_version, describe_nodes, package_versions
from raylane.tracking.compare import (
    Difference,
    cluster_shape,
    differences,
    first_divergence,
    metric_histories,
    run_record,
)
from raylane.tracking.identity import code_digest
from raylane.tracking.lineage import pinned_base, resolve_base
from raylane.tracking.runs import CONFIG_ARTIFACT
from raylane.train.job import run_training

log = logging.getLogger("raylane")

# What must match before a re-run is worth its compute. The git commit is shown but does not
# block: a commit that changed no raylane source leaves the code digest equal.
PRECONDITIONS = ("code", "data", "base", "versions", "cluster")
INFORMATIONAL = {("code", "git commit"), ("code", "git dirty")}


class DriftError(RuntimeError):
    """The present differs from the recorded run and --allow-drift was not given."""


@dataclass(frozen=True)
class Reproduction:
    original_run_id: str
    run_id: str
    verdict: str  # "identical" or "differs"
    detail: str


def recorded_config(client: MlflowClient, run_id: str) -> RaylaneConfig:
    """The run's resolved config, as it logged it."""
    from pathlib import Path

    try:
        text = Path(client.download_artifacts(run_id, CONFIG_ARTIFACT)).read_text()
    except Exception as exc:
        raise ConfigError(
            f"run {run_id} has no {CONFIG_ARTIFACT}: not a raylane training run"
        ) from exc
    return RaylaneConfig.model_validate(yaml.safe_load(text))


def present_record(cfg: RaylaneConfig) -> dict[str, dict[str, str]]:
    """The same sections as a run record, measured now (Ray must be connected)."""
    ensure_dataset(cfg)
    versions = package_versions()
    code = code_version()
    return {
        "code": {
            "raylane.code_digest": code_digest(),
            "git commit": code["git_commit"] or "unknown",
            "git dirty": str(code["git_dirty"]),
        },
        "data": {"dataset digest": dataset_digest(cfg.data.train_path, cfg.data.validation_path)},
        "versions": {k: str(versions[k]) for k in ("python", "ray", "torch", "mlflow")},
        "cluster": cluster_shape({"nodes": describe_nodes()}),
    }


def present_base(client: MlflowClient, recorded: dict[str, str]) -> dict[str, str]:
    """A fine-tuning run's base as the registry holds it now: the recorded version (a
    reproduction fine-tunes that version, not where an alias points now) and the weights
    digest its run recorded ('missing' when the version is gone). Empty for other runs."""
    if not recorded:
        return {}
    name, version = recorded["base_model"], recorded["base_version"]
    try:
        run_id = client.get_model_version(name, version).run_id
        digest = client.get_run(run_id).data.tags.get("raylane.weights_digest", "-")
    except Exception:  # noqa: BLE001 - MLflow raises several kinds for a deleted version
        digest = "missing"
    return {"base_model": name, "base_version": version, "base_digest": digest}


def drift_table(recorded: dict, present: dict, run_id: str) -> tuple[Table, list[Difference]]:
    """Each precondition key: recorded, present, and whether they match."""
    drift = differences(recorded, present, PRECONDITIONS)
    differing = {(d.section, d.key) for d in drift}
    table = Table(title=f"run {run_id} vs now")
    for name in ("", "what", "recorded", "now"):
        table.add_column(name)
    for section in PRECONDITIONS:
        for key in sorted(set(recorded.get(section, {})) | set(present.get(section, {}))):
            same = (section, key) not in differing
            table.add_row(
                "[green]=[/]" if same else "[red]≠[/]",
                f"{section}: {key}",
                _short(recorded.get(section, {}).get(key, "-")),
                _short(present.get(section, {}).get(key, "-")),
            )
    return table, drift


def _short(value: str) -> str:
    return value[:16] if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else value


def compare_runs(client: MlflowClient, original: str, again: str) -> tuple[str, str]:
    """("identical", "") or ("differs", first epoch/metric that differs, or the weights)."""
    divergence = first_divergence(
        metric_histories(client, original), metric_histories(client, again)
    )
    if divergence:
        return "differs", divergence
    weights = [client.get_run(r).data.tags.get("raylane.weights_digest") for r in (original, again)]
    if weights[0] is None:
        return "identical", "(the original run recorded no weights digest)"
    if weights[0] != weights[1]:
        return "differs", f"final weights: digest {weights[0][:16]} vs {weights[1][:16]}"
    return "identical", ""


def refuse_drift(drift: list[Difference], run_id: str, *, allow_drift: bool) -> list[Difference]:
    """The differences that block a re-run (all but the informational ones); raises DriftError
    naming them unless `allow_drift`."""
    blocking = [d for d in drift if (d.section, d.key) not in INFORMATIONAL]
    if blocking and not allow_drift:
        names = ", ".join(f"{d.section} {d.key}" for d in blocking)
        raise DriftError(
            f"the present differs from run {run_id} in {names}; --allow-drift runs it anyway"
        )
    return blocking


def reproduce(client: MlflowClient, run_id: str, *, allow_drift: bool, show) -> Reproduction:
    """Check, re-run and compare. `show` prints a rich renderable. Expects Ray connected."""
    cfg = recorded_config(client, run_id)
    recorded = run_record(client, run_id)
    present = present_record(cfg) | {"base": present_base(client, recorded["base"])}
    table, drift = drift_table(recorded, present, run_id)
    show(table)
    refuse_drift(drift, run_id, allow_drift=allow_drift)
    base = None
    if cfg.finetune is not None:  # the base the run recorded, with the weights it recorded
        tags = client.get_run(run_id).data.tags
        cfg = pinned_base(cfg, tags)
        base = resolve_base(cfg, client.tracking_uri, tags.get("raylane.base_digest"))
    outcome = run_training(cfg, register=False, tags={"raylane.reproduces": run_id}, base=base)
    verdict, detail = compare_runs(client, run_id, outcome.run_id)
    client.set_tag(outcome.run_id, "raylane.reproduced", verdict)
    return Reproduction(run_id, outcome.run_id, verdict, detail)
