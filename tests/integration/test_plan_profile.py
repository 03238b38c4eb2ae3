"""The profile job on the session cluster: it measures a GPT block and the worker group's
links, lands in MLflow, and is reused while model and cluster are unchanged."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.plan.profile_job import load_or_measure, measured_cluster

from .conftest import ROOT, lm_overrides


def test_profile_measures_once_then_is_reused(ray_cluster, workspace):
    cfg = load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        lm_overrides(
            workspace,
            "parallelism.strategy=ddp",
            "parallelism.pp=1",
            "parallelism.workers=2",
            "parallelism.torch_threads=1",
            "parallelism.resources_per_worker.CPU=0.25",
        ),
    )
    found, run_id, reused = load_or_measure(cfg, workspace.tracking_uri)
    assert not reused and found["workers"] == 2
    assert found["block_s"]["8"] > found["block_s"]["1"] > 0  # more rows take longer
    assert found["block_flops_per_s"] > 1e8
    assert found["all_reduce"]["beta_s_per_byte"] > 0 and found["p2p"] is not None

    run = MlflowClient(tracking_uri=workspace.tracking_uri).get_run(run_id)
    assert run.data.metrics["block_flops_per_s"] == found["block_flops_per_s"]
    again, again_id, reused_again = load_or_measure(cfg, workspace.tracking_uri)
    assert reused_again and again_id == run_id and again == found

    cluster = measured_cluster(found, memory_gb=8)
    assert cluster.basis == "measured" and cluster.devices == 2
    assert cluster.device.peak_flops["fp32"] == found["block_flops_per_s"]
