"""A small real parallelism search on the session cluster: the model is profiled by a real
Ray Train job, every layout predicted, and the top k measured as real Ray Train jobs."""

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
                "batch_size": [16, 32],
                # A checkpoint that does not exist: that trial fails at run time.
                "extra": {"training.resume_from": [None, str(workspace.root / "missing")]},
            },
            "trial": {"epochs": 3, "steps_per_epoch": 4},
            # Four valid layouts (two batch sizes x two checkpoints): the two predicted fastest
            # share a batch size, and one of them crashes.
            "predict": {"top_k": 2},
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


def test_only_the_top_k_predicted_are_measured_and_predictions_sit_next_to_measurements(
    search, workspace
):
    spec, result = search
    outcome = result.outcome
    launched = [t.predicted.samples_per_s for t in outcome.trials]
    skipped = [t.predicted.samples_per_s for t in outcome.not_run]
    assert len(launched) == 2 and len(skipped) == 2
    assert min(launched) >= max(skipped)  # the measured ones were predicted fastest
    assert {t.status for t in outcome.not_run} == {"not run"}
    batch = {t.candidate.overrides["training.batch_size"] for t in outcome.trials}
    assert len(batch) == 1  # both measured trials share the predicted-faster batch size

    # The one trial that ran calibrates the rest; its prediction then equals its measurement.
    (ok,) = [t for t in outcome.trials if t.status == "ok"]
    assert outcome.calibration is not None and outcome.calibration.layouts == (ok.candidate.key,)
    assert ok.step_ms > 0 and ok.predicted.step_ms == pytest.approx(ok.step_ms)
    assert 0.2 < outcome.calibration.step_scale < 5  # the profile is the right magnitude

    # The profile is a run of its own, found again by its key.
    profile = MlflowClient(tracking_uri=workspace.tracking_uri).get_run(outcome.profile_run_id)
    assert profile.data.metrics["block_flops_per_s"] > 1e8
    assert outcome.profile_s > 0


def test_outputs_csv_plot_and_nested_mlflow_runs(search, workspace):
    spec, result = search
    with result.csv_path.open() as handle:
        table = list(csv.DictReader(handle))
    assert {row["status"] for row in table} >= {"ok", "failed", "pruned", "not run"}
    assert all(float(row["predicted_step_ms"]) > 0 for row in table if row["status"] != "pruned")
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
    assert len(children) == 4  # two measured, two predicted only
    ok = [c for c in children if c.data.tags["raylane.trial_status"] == "ok"]
    assert all(c.data.metrics["samples_per_s"] > 0 for c in ok)
    assert all(c.data.metrics["predicted_step_ms"] > 0 for c in children)
    assert all("parallelism.workers" in c.data.params for c in children)
