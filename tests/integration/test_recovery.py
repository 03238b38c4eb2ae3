"""Recovery is deterministic: a run whose driver is killed and then continued with `raylane
train --resume RUN_ID` (DDP), and `raylane reproduce` of a pipeline run whose worker is
SIGKILLed mid-run (max_failures=1: Ray Train replaces the worker group, each stage reloads its
checkpoint part), both end with exactly the weights and per-epoch metrics of the session's
uninterrupted reference run.

The driver run uses the reference run's config; only names that do not touch the computation
(the experiment, the registered model, the failure budget) differ. The reproduction is the
pipeline reference run's own recorded config. And a run that could not be reproduced, its
workers importing other raylane code than its driver, stops before its first step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raylane.tracking.identity import code_digest, package_dir
from raylane.train.errors import CODE_MISMATCH

from .conftest import REFERENCE

pytestmark = pytest.mark.integration


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "raylane.cli", "train", *args]


def _env(ray_cluster) -> dict[str, str]:
    return {**ray_cluster.client_env, "RAY_ADDRESS": ray_cluster.address, "COLUMNS": "200"}


def _set(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _same_as_reference(trained, workspace, experiment: str) -> list[str]:
    cfg, _ = trained
    return workspace.overrides(
        f"training.epochs={cfg.training.epochs}",
        f"tracking.system_metrics_interval_s={cfg.tracking.system_metrics_interval_s}",
        f"data.feed={cfg.data.feed}",  # the reference reads through Ray Data
        f"experiment={experiment}",
        f"tracking.registered_model=raylane-{experiment}",
        "training.max_failures=1",
    )


def _wait_for_run(
    client: MlflowClient, experiment: str, epochs_done: int, filter_string="", timeout_s=300
):
    """The experiment's newest run (among those `filter_string` selects) once it has logged
    `epochs_done` epochs (and its placement)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([found.experiment_id], filter_string) if found else []
        if runs:
            run_id = runs[0].info.run_id
            history = client.get_metric_history(run_id, "val_loss")
            if len(history) >= epochs_done:
                return run_id
        time.sleep(0.1)
    raise TimeoutError(f"{experiment}: {epochs_done} epochs not logged in {timeout_s} s")


def _placement(client: MlflowClient, run_id: str) -> list[dict]:
    path = client.download_artifacts(run_id, "parallel/placement.json")
    return json.loads(Path(path).read_text())["ranks"]


def _last_per_epoch(client: MlflowClient, run_id: str, key: str) -> list[float]:
    by_step = {}
    for metric in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
        by_step[metric.step] = metric.value
    return [by_step[step] for step in sorted(by_step)]


def _assert_same_as_reference(client: MlflowClient, run_id: str, trained) -> None:
    _, reference = trained
    ran, ref = client.get_run(run_id), client.get_run(reference.run_id)
    assert ran.info.status == "FINISHED"
    assert ran.data.tags["raylane.weights_digest"] == ref.data.tags["raylane.weights_digest"]
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert _last_per_epoch(client, run_id, key) == _last_per_epoch(
            client, reference.run_id, key
        ), key


def test_a_killed_driver_resumes_the_same_run_and_ends_identical(ray_cluster, workspace, trained):
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    experiment = "recovery-driver"
    env = {**_env(ray_cluster), "MLFLOW_TRACKING_URI": workspace.tracking_uri}
    process = subprocess.Popen(
        _cli("--config", str(REFERENCE),
             *_set(_same_as_reference(trained, workspace, experiment))),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        run_id = _wait_for_run(client, experiment, epochs_done=2)
    finally:
        process.send_signal(signal.SIGKILL)  # a preempted head: no clean-up at all
        process.wait(timeout=60)
    assert len(client.get_metric_history(run_id, "val_loss")) < trained[0].training.epochs

    resumed = subprocess.run(
        _cli("--resume", run_id),
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert f"run {run_id}" in resumed.stdout + resumed.stderr
    assert client.get_run(run_id).data.tags["raylane.resumed"] == "true"
    _assert_same_as_reference(client, run_id, trained)


def test_reproducing_a_pipeline_run_replaces_a_killed_stage_and_ends_identical(
    ray_cluster, workspace, pipeline_run
):
    """`raylane reproduce` of the session's pp=2 pipeline run, its last stage SIGKILLed after
    the first epoch: the recorded failure budget (max_failures=1) replaces the worker, the
    restarted group reloads each stage's checkpoint part, the checks pass, and the re-run ends
    identical to the original."""
    cfg, original = pipeline_run
    assert cfg.training.max_failures == 1  # recorded with the run: the reproduction has it too
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    env = {**_env(ray_cluster), "MLFLOW_TRACKING_URI": workspace.tracking_uri}
    process = subprocess.Popen(
        [sys.executable, "-m", "raylane.cli", "reproduce", original.run_id],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        run_id = _wait_for_run(
            client, cfg.experiment, epochs_done=1,
            filter_string=f"tags.`raylane.reproduces` = '{original.run_id}'",
        )  # fmt: skip
        victim = next(rank for rank in _placement(client, run_id) if rank["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)  # the last stage
        output, _ = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, output[-4000:]
    assert "identical" in output and "≠" not in output, output[-4000:]
    assert next(r for r in _placement(client, run_id) if r["rank"] == 1)["pid"] != victim["pid"]
    again = client.search_runs(
        [client.get_run(original.run_id).info.experiment_id],
        filter_string=f"tags.`raylane.reproduces` = '{original.run_id}'",
    )
    assert [r.info.run_id for r in again] == [run_id]
    assert again[0].data.tags["raylane.reproduced"] == "identical"
    _assert_same_as_reference(client, run_id, pipeline_run)


def test_workers_importing_other_code_than_the_driver_stop_the_run_in_one_line(
    ray_cluster, workspace, tmp_path
):
    """The driver imports a copy of raylane with one byte changed (its PYTHONPATH), the
    workers the cluster's own installed copy (Ray hands them the driver's working directory,
    not its PYTHONPATH): the run stops before its first step, in one line naming both."""
    copy = tmp_path / "platform" / "raylane"
    shutil.copytree(package_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "__init__.py").open("a") as init:
        init.write("# a local edit\n")
    experiment = "mixed-code"
    env = {**_env(ray_cluster), "PYTHONPATH": str(copy.parent)}
    ran = subprocess.run(
        _cli("--config", str(REFERENCE),
             *_set(workspace.overrides("training.epochs=1", f"experiment={experiment}"))),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = ran.stdout + ran.stderr
    assert ran.returncode == 2, output[-4000:]
    (said,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert said.startswith(f"error: {CODE_MISMATCH}: "), said
    assert f"driver: {code_digest(copy)[:12]} at {copy}" in said, said
    assert f"{code_digest()[:12]} at {package_dir()}" in said, said
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    # Stopped where the workers compare their code, at the group's start: no epoch ended.
    found = set(client.get_run(run.info.run_id).data.metrics)
    assert not found & {"train_loss", "val_loss", "epoch_time_s"}, found
