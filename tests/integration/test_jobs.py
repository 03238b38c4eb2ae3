"""`ray job submit` of the training pipeline to the session's `ray start --head` cluster."""

from __future__ import annotations

import json
import subprocess
import time

from mlflow.tracking import MlflowClient

from .conftest import ROOT, ray_cli_path


def _submit(cluster, env, *entrypoint: str, runtime_env: dict | None = None):
    command = [
        ray_cli_path(),
        "job",
        "submit",
        "--address",
        cluster.dashboard_url,
        "--working-dir",
        str(ROOT),
    ]
    if runtime_env:
        command += ["--runtime-env-json", json.dumps(runtime_env)]
    # Right after `ray start` the head's job agent may not be up yet; Ray answers "No available
    # agent to submit job, please try again later", and a client is expected to retry.
    for _ in range(24):
        result = subprocess.run(
            [*command, "--", *entrypoint],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        if "No available agent" not in result.stdout + result.stderr:
            return result
        time.sleep(5)
    return result


def test_submitted_training_job_succeeds_and_lands_in_mlflow(ray_cluster, workspace):
    uri = f"sqlite:///{workspace.root}/jobs-mlflow.db"
    result = _submit(
        ray_cluster,
        ray_cluster.client_env,
        "python",
        "pipelines/train.py",
        "--config",
        "configs/train/digits_ddp.yaml",
        "--set",
        "training.epochs=2",
        "--set",
        f"training.storage_path={workspace.root}/job-runs",
        "--set",
        "tracking.registered_model=raylane-digits-job",
        runtime_env={"env_vars": {"MLFLOW_TRACKING_URI": uri}},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in (result.stdout + result.stderr).lower()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("digits-ddp")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["val_accuracy"] > 0.5
    champion = client.get_model_version_by_alias("raylane-digits-job", "champion")
    assert champion.run_id == runs[0].info.run_id


def test_jobs_api_refuses_a_client_with_a_wrong_token(ray_cluster, tmp_path):
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 32)
    env = {**ray_cluster.client_env, "RAY_AUTH_TOKEN_PATH": str(wrong)}
    result = subprocess.run(
        [ray_cli_path(), "job", "list", "--address", ray_cluster.dashboard_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "token" in (result.stdout + result.stderr).lower()
