"""What `raylane reproduce` compares before it runs, read from a run recorded in a real MLflow
store: the run's resolved config comes back as it was logged, and the drift between what the
run recorded (code digest, git commit, dataset digest, versions, cluster) and what raylane
measures now names each key that moved, with both values; a blocking difference refuses the
re-run in one line naming it unless --allow-drift, a moved git commit alone does not.

The present here is this process's own code digest and package versions; the git commit, the
dataset digest and the cluster shape (the last two need a connected Ray cluster to measure)
are given.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from raylane.config import ConfigError, load_config
from raylane.config.loader import config_to_yaml
from raylane.reproduce import INFORMATIONAL, DriftError, drift_table, recorded_config, refuse_drift
from raylane.tracking.cluster import package_versions
from raylane.tracking.compare import run_record
from raylane.tracking.identity import code_digest
from raylane.tracking.runs import CONFIG_ARTIFACT, SNAPSHOT_ARTIFACT

from .test_config import ROOT

DIGITS = ROOT / "configs" / "train" / "digits_ddp.yaml"
VERSION_KEYS = ("python", "ray", "torch", "mlflow")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[MlflowClient, str]:
    root = tmp_path_factory.mktemp("reproduce")
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.create_experiment("runs", artifact_location=(root / "art").as_uri())
    return client, experiment


@pytest.fixture(scope="module")
def now() -> dict[str, dict[str, str]]:
    """The present as `reproduce` measures it, Ray's parts as the runs below recorded them."""
    versions = package_versions()
    return {
        "code": {"raylane.code_digest": code_digest(), "git commit": "c1", "git dirty": "False"},
        "data": {"dataset digest": "d" * 64},
        "base": {},
        "versions": {k: str(versions[k]) for k in VERSION_KEYS},
        "cluster": {"nodes": "1", "cpus": "2", "gpus": "0"},
    }


def _record(store, present, code: str, commit: str, torch: str) -> str:
    """A training run as raylane records one: resolved config, cluster snapshot, tags."""
    client, experiment = store
    run_id = client.create_run(experiment).info.run_id
    client.log_text(run_id, config_to_yaml(load_config(DIGITS)), CONFIG_ARTIFACT)
    versions = present["versions"] | {"torch": torch}
    client.log_dict(run_id, {"versions": versions, "nodes": [{"cpus": 2.0}]}, SNAPSHOT_ARTIFACT)
    tags = {"raylane.code_digest": code, "mlflow.source.git.commit": commit,
            "raylane.git_dirty": "False", "raylane.dataset_digest": "d" * 64}  # fmt: skip
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    return run_id


def _marked(table) -> dict[str, tuple[str, str, str]]:
    mark, what, recorded, now = (list(column._cells) for column in table.columns)
    return {w: (m, r, n) for m, w, r, n in zip(mark, what, recorded, now, strict=True)}


def test_a_run_of_this_code_and_these_versions_differs_only_in_what_does_not_block(store, now):
    present = now["code"]["raylane.code_digest"]
    torch = now["versions"]["torch"]
    run_id = _record(store, now, present, commit="c0", torch=torch)
    assert recorded_config(store[0], run_id) == load_config(DIGITS)
    _, drift = drift_table(run_record(store[0], run_id), now, run_id)
    assert [(d.section, d.key, d.a, d.b) for d in drift] == [("code", "git commit", "c0", "c1")]
    assert {(d.section, d.key) for d in drift} <= INFORMATIONAL
    assert refuse_drift(drift, run_id, allow_drift=False) == []  # runs without --allow-drift


def test_a_run_of_other_code_and_another_torch_names_both_with_their_values(store, now):
    other = "0" * 64
    run_id = _record(store, now, other, commit="c1", torch="2.0.0")
    table, drift = drift_table(run_record(store[0], run_id), now, run_id)
    present_torch = now["versions"]["torch"]
    assert [(d.section, d.key, d.a, d.b) for d in drift] == [
        ("code", "raylane.code_digest", other, now["code"]["raylane.code_digest"]),
        ("versions", "torch", "2.0.0", present_torch),
    ]
    assert not INFORMATIONAL & {(d.section, d.key) for d in drift}  # both block
    with pytest.raises(DriftError) as refused:
        refuse_drift(drift, run_id, allow_drift=False)
    assert str(refused.value) == (
        f"the present differs from run {run_id} in code raylane.code_digest, versions torch; "
        "--allow-drift runs it anyway"
    )
    assert refuse_drift(drift, run_id, allow_drift=True) == drift
    rows = _marked(table)
    assert rows["code: raylane.code_digest"] == (
        "[red]≠[/]",
        "0" * 16,
        now["code"]["raylane.code_digest"][:16],
    )
    assert rows["versions: torch"] == ("[red]≠[/]", "2.0.0", present_torch)
    assert rows["cluster: cpus"] == ("[green]=[/]", "2", "2")
    assert rows["data: dataset digest"][0] == "[green]=[/]"


def test_a_run_without_a_resolved_config_is_not_reproduced(store):
    client, experiment = store
    run_id = client.create_run(experiment).info.run_id
    with pytest.raises(ConfigError, match=f"run {run_id} has no {CONFIG_ARTIFACT}"):
        recorded_config(client, run_id)
