"""A small real parallelism search on the session cluster: trials are real Ray Train jobs."""

from __future__ import annotations

import csv

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from raylane.tune.planner import plan
from raylane.tune.spec import TuneSpec

from .conftest import ROOT


@pytest.fixture(scope="module")
def search(ray_cluster, workspace):
    spec = TuneSpec.model_validate(
        {
            "experiment": "tune-test",
            "base": str(ROOT / "configs" / "train" / "lm_pipeline.yaml"),
            "base_overrides": [
                "data.max_bytes=65536",
                f"data.train_path={workspace.root}/tune-data/train.parquet",
                f"data.validation_path={workspace.root}/tune-data/validation.parquet",
            ],
            "search": {
                "strategy": ["ddp"],
                "workers": [2, 8],  # 8 x 0.5 CPU is over the 2-CPU budget: pruned
                "batch_size": [16],
                # A checkpoint that does not exist: that trial fails at run time.
                "extra": {"training.resume_from": [None, str(workspace.root / "missing")]},
            },
            "trial": {"epochs": 3, "steps_per_epoch": 4},
            "output_dir": str(workspace.root / "generated"),
            "storage_path": str(workspace.root / "tune-runs"),
            "tracking_uri": workspace.tracking_uri,
        }
    )
    return spec, plan(spec, Console(stderr=True))


def test_search_measures_trials_and_survives_a_crashed_one(search):
    spec, result = search
    statuses = {t.candidate.key: t.status for t in result.outcome.trials}
    assert len(statuses) == 2
    failed = [t for t in result.outcome.trials if t.status == "failed"]
    assert len(failed) == 1 and all("missing" in t.detail for t in failed)
    measured = [t for t in result.outcome.trials if t.samples_per_s]
    assert len(measured) == 1 and all(t.samples_per_s > 0 and t.peak_rss_mb > 0 for t in measured)
    winner = result.outcome.winner
    assert winner is not None and winner.status == "ok"
    assert winner.samples_per_s == max(t.samples_per_s for t in measured)


def test_outputs_csv_plot_and_nested_mlflow_runs(search, workspace):
    spec, result = search
    with result.csv_path.open() as handle:
        table = list(csv.DictReader(handle))
    assert {row["status"] for row in table} >= {"ok", "failed", "pruned"}
    assert table[0]["layout"] == result.outcome.winner.candidate.key
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    parent = client.get_run(result.mlflow_run_id)
    assert parent.data.tags["raylane.winner"] == result.outcome.winner.candidate.key
    artifacts = {a.path for a in client.list_artifacts(result.mlflow_run_id)}
    assert {result.csv_path.name, result.plot_path.name, result.best_config.name} <= artifacts
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.mlflow_run_id}'",
    )
    assert len(children) == 2
    ok = [c for c in children if c.data.tags["raylane.trial_status"] == "ok"]
    assert all(c.data.metrics["samples_per_s"] > 0 for c in ok)
    assert all("parallelism.workers" in c.data.params for c in children)
