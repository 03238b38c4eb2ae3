"""A small real parallelism search on the session cluster: the model's profile (the session's,
measured by a real Ray Train job) is reused, every layout predicted, and the top k measured as
real Ray Train jobs."""

from __future__ import annotations

import csv
import logging

import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from raylane.tune.planner import plan
from raylane.tune.spec import TuneSpec

from .conftest import ROOT


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def search(ray_cluster, workspace, lm_profile):
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
                # 1 and 2: the levels of the session's profile (`lm_profile`), which the
                # search then reuses. 8 x 0.5 CPU is over the 2-CPU budget: pruned.
                "workers": [1, 2, 8],
                "batch_size": [16, 32],
                # A checkpoint that does not exist: that trial fails at run time.
                "extra": {"training.resume_from": [None, str(workspace.root / "missing")]},
            },
            "trial": {"epochs": 3, "steps_per_epoch": 4},
            # Eight valid layouts (two world sizes x two batch sizes x two checkpoints): the
            # two predicted fastest differ only in the checkpoint, and one of them crashes.
            "predict": {"top_k": 2},
            "output_dir": str(workspace.root / "generated"),
            "storage_path": str(workspace.root / "tune-runs"),
            "tracking_uri": workspace.tracking_uri,
        }
    )
    # Whether the profile was measured or reused is an INFO line of the "raylane" logger.
    logger, lines = logging.getLogger("raylane"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        return spec, plan(spec, Console(stderr=True)), lines.lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def test_search_measures_trials_and_survives_a_crashed_one(search):
    spec, result, _ = search
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
    search, workspace, lm_profile
):
    spec, result, logged = search
    outcome = result.outcome
    # Ranked on the profile's own predictions (calibration adds a measured wait per step,
    # which may reorder layouts of different batch sizes afterwards).
    raw = outcome.raw_predictions
    launched = [raw[t.candidate.key].samples_per_s for t in outcome.trials]
    skipped = [raw[t.candidate.key].samples_per_s for t in outcome.not_run]
    assert len(launched) == 2 and len(skipped) == 6 and len(raw) == 8
    assert min(launched) >= max(skipped)  # the measured ones were predicted fastest
    assert {t.status for t in outcome.not_run} == {"not run"}
    batch = {t.candidate.overrides["training.batch_size"] for t in outcome.trials}
    assert len(batch) == 1  # both measured trials share the predicted-faster batch size

    # The one trial that ran calibrates the rest: its measured step work (the step less its
    # wait for input) over the profile's predicted step, and that wait, per step.
    (ok,) = [t for t in outcome.trials if t.status == "ok"]
    calibration = outcome.calibration
    assert calibration is not None and calibration.layouts == (ok.candidate.key,)
    wait_ms = min(ok.data_wait_ms or 0.0, ok.step_ms)
    measured_raw = raw[ok.candidate.key]
    assert calibration.step_scale == pytest.approx((ok.step_ms - wait_ms) / measured_raw.step_ms)
    assert calibration.data_wait_s == pytest.approx(wait_ms / 1000)
    # Every other layout's prediction is the profile's, calibrated by that one trial.
    for trial in [*outcome.not_run, *(t for t in outcome.trials if t is not ok)]:
        assert trial.predicted == calibration.apply(raw[trial.candidate.key]), trial.candidate.key
    # The crashed layout differs only in its checkpoint: the profile predicts it as the one
    # measured, so, calibrated, it is predicted at that trial's measured step.
    (crashed,) = [t for t in outcome.trials if t.status == "failed"]
    assert raw[crashed.candidate.key] == measured_raw, crashed.candidate.key
    assert crashed.predicted.step_ms == pytest.approx(ok.step_ms)

    # The profile is a run of its own, found again by its key: the session's, reused, not
    # measured again.
    assert outcome.profile_run_id == lm_profile.run_id
    assert f"profile reused (MLflow run {lm_profile.run_id}," in " ".join(logged)
    profile = MlflowClient(tracking_uri=workspace.tracking_uri).get_run(outcome.profile_run_id)
    assert profile.data.metrics["block_flops_per_s"] == lm_profile.profile["block_flops_per_s"]
    assert outcome.profile_s > 0


def test_outputs_csv_plot_and_nested_mlflow_runs(search, workspace):
    spec, result, _ = search
    with result.csv_path.open() as handle:
        table = list(csv.DictReader(handle))
    assert {row["status"] for row in table} >= {"ok", "failed", "pruned", "not run"}
    # Each layout's row holds its (calibrated) prediction, as the search returned it.
    predicted = {t.candidate.key: t.predicted for t in [*result.outcome.trials,
                                                        *result.outcome.not_run]}  # fmt: skip
    shown = {row["layout"]: float(row["predicted_step_ms"])
             for row in table if row["status"] != "pruned"}  # fmt: skip
    assert shown == {key: round(p.step_ms, 2) for key, p in predicted.items()}
    assert table[0]["layout"] == result.outcome.winner.candidate.key
    assert result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    parent = client.get_run(result.mlflow_run_id)
    assert parent.data.tags["raylane.winner"] == result.outcome.winner.candidate.key
    scale = result.outcome.calibration.step_scale
    assert parent.data.metrics["prediction_step_scale"] == pytest.approx(scale, rel=1e-12)
    artifacts = {a.path for a in client.list_artifacts(result.mlflow_run_id)}
    assert {result.csv_path.name, result.plot_path.name, result.best_config.name} <= artifacts
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.mlflow_run_id}'",
    )
    assert len(children) == 8  # two measured, six predicted only
    by_layout = {c.info.run_name: c for c in children}
    (ok,) = [c for c in children if c.data.tags["raylane.trial_status"] == "ok"]
    winner = result.outcome.winner
    assert ok.info.run_name == winner.candidate.key
    assert ok.data.metrics["samples_per_s"] == pytest.approx(winner.samples_per_s, rel=1e-12)
    assert {name: c.data.metrics["predicted_step_ms"] for name, c in by_layout.items()} == (
        pytest.approx({key: p.step_ms for key, p in predicted.items()}, rel=1e-12)
    )
    assert all("parallelism.workers" in c.data.params for c in children)
