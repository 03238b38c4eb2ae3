"""Pipeline (pp=2) and hybrid (dp=2 x pp=2) jobs through Ray Train: tracked with their stage
layout, checkpointed per stage and resumable, registered as one model, and served."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.data.parquet import read_rows
from raylane.train.job import run_training

from .conftest import ROOT, free_port
from .triton import triton_infer

CONFIGS = ROOT / "configs" / "train"


def _lm_overrides(workspace, *extra: str) -> list[str]:
    return [
        *workspace.overrides(*extra),
        f"data.train_path={workspace.root}/lm/train.parquet",
        f"data.validation_path={workspace.root}/lm/validation.parquet",
        "data.max_bytes=131072",
    ]


@pytest.fixture(scope="module")
def pipeline_run(ray_cluster, workspace):
    cfg = load_config(CONFIGS / "lm_pipeline.yaml", _lm_overrides(workspace, "training.epochs=2"))
    return cfg, run_training(cfg)


@pytest.fixture(scope="module")
def hybrid_run(ray_cluster, workspace, pipeline_run):
    cfg = load_config(CONFIGS / "lm_hybrid.yaml", _lm_overrides(workspace, "training.epochs=1"))
    return cfg, run_training(cfg)


@pytest.fixture(scope="module")
def client(workspace):
    return MlflowClient(tracking_uri=workspace.tracking_uri)


def test_pipeline_job_learns_and_records_its_layout_and_bubble(pipeline_run, client):
    cfg, outcome = pipeline_run
    history = [m.value for m in client.get_metric_history(outcome.run_id, "train_loss")]
    assert len(history) == 2 and history[1] < history[0]
    assert outcome.metrics["val_loss"] < np.log(256)  # better than a uniform guess
    assert outcome.metrics["bubble_bound_gpipe"] == pytest.approx(1 / 5)
    assert 0.0 < outcome.metrics["bubble_fraction"] < 1.0
    assert outcome.metrics["stage0_busy_s"] > 0 and outcome.metrics["stage1_busy_s"] > 0
    assert outcome.metrics["stage0_peak_activation_mb"] > 0

    layout = client.download_artifacts(outcome.run_id, "parallel/stage_layout.txt")
    assert Path(layout).read_text().splitlines() == [
        "stage 0: embeddings, blocks 0-1 (x1 replicas)",
        "stage 1: blocks 2-3, norm + head (x1 replicas)",
    ]
    manifest = json.loads(
        Path(client.download_artifacts(outcome.run_id, "data/manifest.json")).read_text()
    )
    assert manifest["source"] == "python-stdlib" and manifest["files"]
    assert len(manifest["sha256"]) == 64


def test_each_stage_saves_its_part_and_a_run_resumes_from_them(
    pipeline_run, workspace, ray_cluster
):
    cfg, outcome = pipeline_run
    last = Path(outcome.checkpoint_path)
    assert {"model-part000.pt", "model-part001.pt", "optimizer-part000.pt"} <= {
        p.name for p in last.iterdir()
    }
    resumed_cfg = load_config(
        CONFIGS / "lm_pipeline.yaml",
        _lm_overrides(workspace, "training.epochs=3", f"training.resume_from={last}"),
    )
    resumed = run_training(resumed_cfg)
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    steps = [m.step for m in client.get_metric_history(resumed.run_id, "train_loss")]
    assert steps == [2]  # epochs 0-1 came from the checkpoint
    assert resumed.metrics["train_loss"] < outcome.metrics["train_loss"]


def test_hybrid_job_runs_dp2_pp2(hybrid_run, client):
    cfg, outcome = hybrid_run
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    snapshot = json.loads(
        Path(client.download_artifacts(outcome.run_id, "cluster/snapshot.json")).read_text()
    )
    assert (snapshot["run"]["dp"], snapshot["run"]["pp"], snapshot["run"]["workers"]) == (2, 2, 4)
    assert outcome.metrics["val_loss"] < np.log(256)
    layout = Path(client.download_artifacts(outcome.run_id, "parallel/stage_layout.txt"))
    assert "(x2 replicas)" in layout.read_text()


@pytest.fixture(scope="module")
def lm_endpoint(pipeline_run, hybrid_run, workspace):
    from raylane.serving.app import deploy, shutdown_serve

    cfg = load_config(
        CONFIGS / "lm_pipeline.yaml", _lm_overrides(workspace, f"serving.port={free_port()}")
    )
    url, _ = deploy(cfg)
    try:
        yield cfg, url
    finally:
        shutdown_serve()


def test_assembled_model_is_served_and_answers_next_byte_logits(lm_endpoint, workspace):
    cfg, url = lm_endpoint
    tokens, _ = read_rows(cfg.data.validation_path, cfg, limit=3)
    metadata = httpx.get(f"{url}/v2/models/lm").json()
    assert metadata["inputs"][0] == {"name": "features", "datatype": "INT64", "shape": [-1, 64]}
    body = {
        "inputs": [
            {
                "name": "tokens",
                "shape": list(tokens.shape),
                "datatype": "INT64",
                "data": tokens.tolist(),
            }
        ]
    }
    response = httpx.post(f"{url}/v2/models/lm/infer", json=body, timeout=60)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert outputs["logits"]["shape"] == [3, 256]
    next_bytes = outputs["label"]["data"]

    mlflow.set_tracking_uri(workspace.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{cfg.tracking.registered_model}@champion")
    expected = model(torch.from_numpy(tokens))[:, -1, :].argmax(dim=-1).tolist()
    assert next_bytes == expected


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_triton_client_sends_int64_tokens_to_the_lm(lm_endpoint, binary):
    cfg, url = lm_endpoint
    tokens, _ = read_rows(cfg.data.validation_path, cfg, limit=4)
    logits, next_bytes, _ = triton_infer(url, "lm", tokens.astype(np.int64), "INT64", binary)
    assert logits.shape == (4, 256)
    plain = httpx.post(
        f"{url}/v2/models/lm/infer",
        json={
            "inputs": [
                {"name": "t", "shape": [4, 64], "datatype": "INT64", "data": tokens.tolist()}
            ]
        },
        timeout=60,
    ).json()
    assert next_bytes.tolist() == plain["outputs"][1]["data"]
