"""Relaxed consistency through the product's own path: `run_training` on the session cluster
with local SGD, an asynchronous parameter server and bounded staleness, with stragglers taking
turns, tracked in MLflow. And what every run records: the step-time split and the bytes its
workers sent. The limits that must equal synchronous training (local SGD averaging every step,
the parameter server with one worker) are proven step by step in test_layout_equivalence.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.train.job import run_training

from .conftest import REFERENCE

STRAGGLERS = [
    "parallelism.straggler.rank=[0,1]",
    "parallelism.straggler.every=3",
    "parallelism.straggler.delay_s=0.02",
]


def _run(workspace, *extra: str):
    cfg = load_config(
        REFERENCE,
        workspace.overrides(
            "training.epochs=3",
            "tracking.system_metrics_interval_s=0",
            "tracking.registered_model=raylane-consistency",
            *extra,
        ),
    )
    outcome = run_training(cfg, register=False)  # nobody here reads the model
    return cfg, outcome, MlflowClient(tracking_uri=workspace.tracking_uri)


def _last(client, run_id: str, key: str) -> float:
    return client.get_metric_history(run_id, key)[-1].value


def _split_adds_up(client, run_id: str) -> None:
    for epoch in range(3):
        parts = {
            key: client.get_metric_history(run_id, key)[epoch].value
            for key in ("step_ms", "step_data_wait_ms", "step_compute_ms", "step_comm_ms")
        }
        assert parts["step_compute_ms"] > 0 and parts["step_comm_ms"] >= 0
        error = client.get_metric_history(run_id, "step_split_error")[epoch].value
        assert error < 0.2, (epoch, parts, error)


def test_async_parameter_server_learns_and_records_staleness(ray_cluster, workspace):
    # ssp (bounded staleness) with stragglers is the README's consistency block: its bound is
    # checked in test_readme_run.py.
    _, outcome, client = _run(workspace, "parallelism.strategy=async", *STRAGGLERS)
    assert outcome.metrics["val_accuracy"] >= 0.8  # chance is 0.1
    run = outcome.run_id
    histogram = json.loads(
        Path(client.download_artifacts(run, "staleness_histogram.json")).read_text()
    )
    staleness = {int(k): v for k, v in histogram.items()}
    assert sum(staleness.values()) > 0 and max(staleness) >= 1  # some updates were stale
    assert _last(client, run, "staleness_max") == max(staleness)
    assert _last(client, run, "step_straggler_ms") > 0
    # Gradients pushed (fp32) are what a DDP all-reduce would send.
    assert _last(client, run, "comm_bytes_ratio") == pytest.approx(1.0)
    _split_adds_up(client, run)


def test_local_sgd_sends_a_quarter_of_the_bytes_and_learns(ray_cluster, workspace):
    _, outcome, client = _run(
        workspace, "parallelism.strategy=local_sgd", "parallelism.local_sgd_period=4"
    )
    assert outcome.metrics["val_accuracy"] >= 0.8
    ratio = _last(client, outcome.run_id, "comm_bytes_ratio")
    # Steps 0, 4, 8 of a worker's 12 per epoch, plus the average at the epoch's end: 4 / 12.
    assert 0.25 < ratio < 0.35, ratio
    _split_adds_up(client, outcome.run_id)


def test_ddp_run_records_its_step_split_and_bytes(trained, workspace):
    cfg, outcome = trained
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    run = outcome.run_id
    params = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert _last(client, run, "comm_bytes_per_step") == params * 4  # fp32, every gradient
    assert _last(client, run, "comm_bytes_ratio") == 1.0
    history = client.get_metric_history(run, "step_split_error")
    assert len(history) == cfg.training.epochs
    assert "step_time_split.png" in {a.path for a in client.list_artifacts(run)}
