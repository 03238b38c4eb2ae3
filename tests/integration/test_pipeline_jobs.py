"""A pipeline (pp=2) job through Ray Train: tracked with its stage layout, checkpointed per
stage, registered as one model, and served. (The README's pipeline, hybrid dp=2 x pp=2 and
resume commands run as written in test_readme_run.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint import FileSystemReader

from raylane.config import load_config
from raylane.data.parquet import read_rows
from raylane.data.text import stdlib_source_files

from .conftest import ROOT, free_port, lm_overrides
from .triton import triton_infer

CONFIGS = ROOT / "configs" / "train"


@pytest.fixture(scope="module")
def client(workspace):
    return MlflowClient(tracking_uri=workspace.tracking_uri)


def test_pipeline_job_learns_and_records_its_layout_and_bubble(pipeline_run, client):
    cfg, outcome = pipeline_run
    history = [m.value for m in client.get_metric_history(outcome.run_id, "train_loss")]
    assert len(history) == 2 and history[1] < history[0]
    assert outcome.metrics["val_loss"] < np.log(256)  # better than a uniform guess
    metrics = outcome.metrics
    bound = (cfg.parallelism.pp - 1) / (cfg.parallelism.microbatches + cfg.parallelism.pp - 1)
    assert metrics["bubble_bound_gpipe"] == pytest.approx(bound) == pytest.approx(1 / 5)
    # The measured bubble: the stages' waiting over their wall time, never under GPipe's bound
    # for equal stages and free communication (each micro-batch's sends and the stages'
    # difference only add to it; benchmarks/README.md, pipeline_bubble).
    busy = [metrics[f"stage{s}_busy_s"] for s in range(2)]
    idle = [metrics[f"stage{s}_idle_s"] for s in range(2)]
    assert min(busy) > 0
    assert metrics["bubble_fraction"] == pytest.approx(sum(idle) / (sum(busy) + sum(idle)))
    assert bound <= metrics["bubble_fraction"] < 1.0
    assert metrics["efficiency_vs_bound"] == pytest.approx(
        (1 - metrics["bubble_fraction"]) / (1 - bound)
    )
    assert outcome.metrics["stage0_peak_activation_mb"] > 0

    layout = client.download_artifacts(outcome.run_id, "parallel/stage_layout.txt")
    assert Path(layout).read_text().splitlines() == [
        "layout: pp 2 (2 workers)",
        "stage 0: embeddings, blocks 0-1 (x1 replicas)",
        "stage 1: blocks 2-3, norm + head (x1 replicas)",
    ]
    manifest = json.loads(
        Path(client.download_artifacts(outcome.run_id, "data/manifest.json")).read_text()
    )
    # The standard library's first files in sorted order, up to the run's data.max_bytes.
    files = stdlib_source_files(cfg.data.max_bytes)
    text = b"".join(path.read_bytes() for path in files)
    assert manifest["source"] == "python-stdlib"
    assert manifest["files"] == [path.name for path in files]
    assert manifest["bytes"] == len(text) <= cfg.data.max_bytes
    assert manifest["sha256"] == hashlib.sha256(text).hexdigest()


def test_each_stage_saves_its_part_of_the_checkpoint(pipeline_run):
    # Resuming from this checkpoint runs as the README's own pipeline commands
    # (test_readme_run.py::test_pipeline_block).
    _, outcome = pipeline_run
    last = Path(outcome.checkpoint_path)
    assert sorted(p.name for p in last.iterdir()) == [
        "meta.json", "model-part000.pt", "model-part001.pt", "sharded"
    ]  # fmt: skip
    # The stages' DCP files hold the whole model's parameters and optimizer state, each
    # stage's under the whole model's names: they merge, and resume cut at other blocks.
    stored = FileSystemReader(str(last / "sharded")).read_metadata().state_dict_metadata
    for part in ("model-part000.pt", "model-part001.pt"):
        weights = torch.load(last / part, weights_only=True)
        assert weights
        for name, tensor in weights.items():
            assert stored[f"model.{name}"].size == tensor.shape
            assert stored[f"optimizer.state.{name}.exp_avg"].size == tensor.shape


@pytest.fixture(scope="module")
def lm_endpoint(pipeline_run, workspace):
    from raylane.serving.app import deploy, shutdown_serve

    cfg = load_config(
        CONFIGS / "lm_pipeline.yaml", lm_overrides(workspace, f"serving.port={free_port()}")
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
    with torch.no_grad():
        last = model(torch.from_numpy(tokens))[:, -1, :]
    assert next_bytes == last.argmax(dim=-1).tolist()
    # The logits themselves: the registered model's, for each row's last position.
    served = np.asarray(outputs["logits"]["data"], dtype=np.float32).reshape(3, 256)
    np.testing.assert_allclose(served, last.numpy(), rtol=1e-4, atol=1e-5)


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
    answered = {o["name"]: o["data"] for o in plain["outputs"]}
    assert next_bytes.tolist() == answered["label"]
    # Binary or JSON, the client reads the same float32 logits the plain request gets.
    np.testing.assert_array_equal(
        logits, np.asarray(answered["logits"], dtype=np.float32).reshape(4, 256)
    )
