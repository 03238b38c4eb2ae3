"""The profile job on Ray Train, its MLflow run, and its reuse while the model's shape and the
cluster are unchanged (runs are found by a key over both)."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from raylane.config import RaylaneConfig
from raylane.models.families import shape_of
from raylane.plan.hardware import Accelerator, Cluster, ClusterSpec
from raylane.tracking.cluster import describe_nodes, package_versions
from raylane.train.trainer import prompt_health_checks

KEY_TAG = "raylane.profile_key"
ARTIFACT = "profile.json"


def concurrency_levels(cfg: RaylaneConfig, levels: list[int] | None) -> list[int]:
    """The worker counts to measure at: the given ones (a search's world sizes), else the
    config's own worker count."""
    found = sorted(set(levels or [cfg.parallelism.workers]))
    if found[0] < 1:
        raise ValueError(f"worker counts to profile must be at least 1, got {found}")
    return found


def profile_key(cfg: RaylaneConfig, levels: list[int]) -> str:
    """What the figures depend on: the model's shape, the worker groups and the nodes."""
    par = cfg.parallelism
    versions = package_versions()
    basis = {
        # What the profile measures: a profile of an older schema is measured again (2: the
        # sharded layouts' wrapped blocks and the parameter server's round trip; 3: any
        # family's block, keyed by its whole shape, and a block under ring attention).
        "schema": 3,
        "model": [cfg.model.kind, asdict(shape_of(cfg.model))],
        "optimizer": cfg.training.optimizer,
        "levels": levels,
        "resources_per_worker": par.resources_per_worker,
        "torch_threads": par.torch_threads,
        "use_gpu": par.use_gpu,
        "nodes": sorted((n["cpus"], n["gpus"]) for n in describe_nodes()),
        "versions": [versions["torch"], versions["ray"]],
    }
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def measure(cfg: RaylaneConfig, levels: list[int]) -> dict[str, Any]:
    """Run the profile job: as many workers as the largest level, each reserving what the
    config's workers reserve."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # lazy: torch; a stored profile is reused without it
    from raylane.profile.worker import profile_worker

    prompt_health_checks()
    par = cfg.parallelism
    trainer = TorchTrainer(
        profile_worker,
        train_loop_config={"config": cfg.model_dump(mode="json"), "concurrency": levels},
        torch_config=TorchConfig(backend="nccl" if par.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=max(levels),
            use_gpu=par.use_gpu,
            resources_per_worker=dict(par.resources_per_worker),
        ),
        run_config=RunConfig(
            name=f"profile-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str(Path(cfg.training.storage_path).resolve()),
        ),
    )
    return trainer.fit().return_value


def load_or_measure(
    cfg: RaylaneConfig,
    tracking_uri: str,
    refresh: bool = False,
    concurrency: list[int] | None = None,
) -> tuple[dict[str, Any], str, bool]:
    """The profile, the MLflow run holding it, and whether an earlier run was reused."""
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    levels = concurrency_levels(cfg, concurrency)
    key = profile_key(cfg, levels)
    name = f"{cfg.experiment}-profile"
    experiment = client.get_experiment_by_name(name)
    if experiment is not None and not refresh:
        found = client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.`{KEY_TAG}` = '{key}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if found:
            run_id = found[0].info.run_id
            with tempfile.TemporaryDirectory() as directory:
                path = client.download_artifacts(run_id, ARTIFACT, directory)
                return json.loads(Path(path).read_text()), run_id, True
    profile = measure(cfg, levels)
    shape = shape_of(cfg.model)
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(name)
    with mlflow.start_run(run_name="profile") as run:
        mlflow.set_tag(KEY_TAG, key)
        mlflow.log_params(
            {
                "model.kind": cfg.model.kind,
                "model.d_model": shape.d_model,
                "model.n_layers": shape.n_layers,
                "model.input_dim": cfg.model.input_dim,
                "concurrency": ",".join(map(str, levels)),
            }
        )
        metrics = {"block_flops_per_s": profile["block_flops_per_s"]}
        for link in ("all_reduce", "p2p"):
            if profile[link] is not None:
                metrics[f"{link}_alpha_s"] = profile[link]["alpha_s"]
                metrics[f"{link}_beta_s_per_byte"] = profile[link]["beta_s_per_byte"]
        mlflow.log_metrics(metrics)
        mlflow.log_dict(profile, ARTIFACT)
    return profile, run.info.run_id, False


def measured_cluster(profile: dict[str, Any], memory_gb: float) -> Cluster:
    """The cost model's view of the profiled worker group: one node of `workers` devices whose
    achieved FLOP/s and ring all-reduce bandwidth are the measured ones."""
    workers = profile["workers"]
    ring = profile["all_reduce"]
    if ring is not None and ring["beta_s_per_byte"] > 0:
        # A ring all-reduce moves 2(n - 1)/n of the bytes per device.
        gbps = 2 * (workers - 1) / workers / ring["beta_s_per_byte"] / 1e9
        latency_us = ring["alpha_s"] / (2 * (workers - 1)) * 1e6
    else:
        gbps, latency_us = 1e3, 0.0
    device = Accelerator(
        peak_flops={"fp32": profile["block_flops_per_s"]},
        memory_gb=memory_gb,
        intra_node_gbps=gbps,
        inter_node_gbps=gbps,
    )
    spec = ClusterSpec(
        nodes=1, devices_per_node=workers, accelerator="measured", link_latency_us=latency_us
    )
    return Cluster(spec, device, basis="measured")
