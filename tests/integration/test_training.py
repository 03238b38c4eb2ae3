"""The reference DDP job through Ray Train, tracked and registered in a real MLflow store."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint import FileSystemReader

from raylane.config import load_config

from .conftest import REFERENCE, ROOT


@pytest.fixture(scope="module")
def client(workspace):
    return MlflowClient(tracking_uri=workspace.tracking_uri)


def test_ddp_run_learns(trained, client):
    cfg, outcome = trained
    assert outcome.metrics["val_accuracy"] >= 0.9
    history = client.get_metric_history(outcome.run_id, "train_loss")
    assert [m.step for m in history] == list(range(cfg.training.epochs))
    assert history[-1].value < 0.5 * history[0].value
    val_loss = [m.value for m in client.get_metric_history(outcome.run_id, "val_loss")]
    assert val_loss[-1] < val_loss[0]
    throughput = client.get_metric_history(outcome.run_id, "train_samples_per_s")
    assert all(m.value > 0 for m in throughput)


def test_run_records_params_config_cluster_and_dataset(trained, client):
    cfg, outcome = trained
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["parallelism.workers"] == "2"
    assert run.data.params["training.epochs"] == str(cfg.training.epochs)
    assert run.data.params["tracking.registered_model"] == cfg.tracking.registered_model

    artifacts = {a.path for a in client.list_artifacts(outcome.run_id, "config")}
    assert "config/resolved.yaml" in artifacts
    resolved = load_config(Path(client.download_artifacts(outcome.run_id, "config/resolved.yaml")))
    assert resolved == cfg

    snapshot = json.loads(
        Path(client.download_artifacts(outcome.run_id, "cluster/snapshot.json")).read_text()
    )
    import ray
    import torch

    assert snapshot["versions"]["ray"] == ray.__version__
    assert snapshot["versions"]["torch"] == torch.__version__
    assert [n["cpus"] for n in snapshot["nodes"]] == [4.0] and snapshot["nodes"][0]["is_head"]
    assert snapshot["cluster_resources"]["CPU"] == 4.0
    assert snapshot["run"] == {
        "seed": 0,
        "strategy": "ddp",
        "workers": 2,
        "dp": 1,
        "pp": 1,
        "resources_per_worker": {"CPU": 0.5},
        "use_gpu": False,
        "placement_strategy": "PACK",
        "precision": "fp32",
        "compile": False,
    }
    assert run.data.params["training.compile"] == "False"  # recorded with the run
    # The checkout the driver ran from (this repository): its commit, and whether tracked
    # files differ from it (the diff then a run artifact of its own, not in the snapshot).
    head = _git("rev-parse", "HEAD").strip()
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    assert snapshot["code"] == {"git_commit": head, "git_dirty": dirty, "git_source": "checkout"}
    assert len(head) == 40 and run.data.tags["mlflow.source.git.commit"] == head
    assert run.data.tags["raylane.git_dirty"] == str(dirty)

    inputs = run.inputs.dataset_inputs
    contexts = {
        next(t.value for t in i.tags if t.key == "mlflow.data.context"): i.dataset for i in inputs
    }
    assert set(contexts) == {"training", "validation"}
    assert all(len(d.digest) == 16 for d in contexts.values())
    assert run.data.tags["raylane.dataset_digest"] != contexts["training"].digest


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    ).stdout


def test_checkpoint_per_epoch_holds_model_optimizer_and_epoch(trained):
    cfg, outcome = trained
    last = Path(outcome.checkpoint_path)
    # One format for every layout: DCP (one file per worker, the replicas' copy once, AdamW's
    # moments beside each parameter), and the assembled model that registration loads.
    assert sorted(p.name for p in last.iterdir()) == ["meta.json", "model-part000.pt", "sharded"]
    sharded = last / "sharded"
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    stored = FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
    weights = torch.load(last / "model-part000.pt", weights_only=True)
    for name, tensor in weights.items():
        assert stored[f"model.{name}"].size == tensor.shape
        assert stored[f"optimizer.state.{name}.exp_avg"].size == tensor.shape
    assert json.loads((last / "meta.json").read_text())["epoch"] == cfg.training.epochs - 1
    # The newest two of all: the last epoch's last step checkpoint, and its end.
    kept = sorted(p.name for p in last.parent.glob("epoch_*"))
    (inside,) = [name for name in kept if name != last.name]
    assert len(kept) == 2 and re.fullmatch(rf"{last.name}_step_\d{{6}}", inside), kept
    step = json.loads((last.parent / inside / "meta.json").read_text())
    assert step["epoch"] == cfg.training.epochs - 1 and step["step"] % 4 == 0
    # Inside the epoch: some of its rows trained on, not all (the end has its own checkpoint).
    import pyarrow.parquet as pq

    assert 0 < step["rows"] < pq.read_metadata(cfg.data.train_path).num_rows


def test_a_run_continues_exactly_from_a_checkpoint_inside_an_epoch(trained, workspace):
    """`resume_from` a step checkpoint (what a restarted worker group gets too): the epoch's
    remaining steps on the same batches, the same final weights and losses."""
    from raylane.train.checkpointing import load_model_state
    from raylane.train.job import run_training

    from .conftest import TRAINED

    cfg, outcome = trained
    last = Path(outcome.checkpoint_path)
    inside = sorted(last.parent.glob(f"{last.name}_step_*"))[-1]
    resumed_cfg = load_config(
        REFERENCE, workspace.overrides(*TRAINED, f"training.resume_from={inside}")
    )
    resumed = run_training(resumed_cfg, register=False)
    final, again = load_model_state(last), load_model_state(Path(resumed.checkpoint_path))
    assert final.keys() == again.keys()
    for name in final:
        assert torch.equal(final[name], again[name]), name
    client = MlflowClient(workspace.tracking_uri)
    for key in ("train_loss", "val_loss"):
        (original,) = [m.value for m in client.get_metric_history(outcome.run_id, key)
                       if m.step == cfg.training.epochs - 1]  # fmt: skip
        (continued,) = [m.value for m in client.get_metric_history(resumed.run_id, key)]
        assert continued == pytest.approx(original, rel=1e-6), key


def test_champion_alias_resolves_to_a_model_that_predicts(trained, client, workspace):
    cfg, outcome = trained
    name = cfg.tracking.registered_model
    champion = client.get_model_version_by_alias(name, "champion")
    assert int(champion.version) == outcome.model_version
    assert champion.run_id == outcome.run_id

    import pyarrow.parquet as pq

    table = pq.read_table(cfg.data.validation_path)
    features = np.stack(table.column("features").to_numpy(zero_copy_only=False))[:100]
    labels = table.column("label").to_numpy()[:100]
    mlflow.set_tracking_uri(workspace.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{name}@champion")
    import torch

    predicted = model(torch.from_numpy(features.astype(np.float32))).argmax(dim=1).numpy()
    assert (predicted == labels).mean() >= 0.9


def test_worse_model_does_not_take_alias_and_verbose_shows_ray_logs(
    ray_cluster, trained, client, workspace
):
    # That seeded runs repeat exactly is shown by test_recovery.py (interrupted runs end with
    # the reference run's weights digest) and by the README's `raylane reproduce`.
    # The quiet default console (epoch lines only, at most ~30) is checked on the README's own
    # `raylane train` command in test_readme_run.py; this run asks for Ray's logs.
    cfg, champion_outcome = trained
    env = {**ray_cluster.client_env, "RAY_ADDRESS": ray_cluster.address, "COLUMNS": "200"}
    weak = workspace.overrides("training.epochs=1", "training.lr=0.0001")
    done = subprocess.run(
        [sys.executable, "-m", "raylane.cli", "train", "--config", str(REFERENCE),
         *[a for o in weak for a in ("--set", o)], "--verbose"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    ray_markers = ("TrainController", "RayTrainWorker", "SplitCoordinator", "TrainingReport")
    assert any(m in output for m in ray_markers), output[-3000:]

    run_id = re.search(r"MLflow run ([0-9a-f]{32})", output).group(1)
    first = client.get_run(run_id)
    assert first.data.metrics["val_accuracy"] < champion_outcome.metrics["val_accuracy"]
    (version,) = client.search_model_versions(f"run_id = '{run_id}'")
    assert int(version.version) != champion_outcome.model_version  # registered, not promoted
    champion = client.get_model_version_by_alias(cfg.tracking.registered_model, "champion")
    assert int(champion.version) == champion_outcome.model_version


def test_worker_output_and_node_system_metrics_are_kept_with_the_run(trained, client):
    _, outcome = trained
    logs = {a.path for a in client.list_artifacts(outcome.run_id, "logs")}
    assert {"logs/rank-0.err", "logs/rank-1.err"} <= logs, logs
    text = Path(client.download_artifacts(outcome.run_id, "logs/rank-0.err")).read_text()
    assert "Setting up process group" in text  # Ray Train's own line from that worker

    placement = json.loads(
        Path(client.download_artifacts(outcome.run_id, "parallel/placement.json")).read_text()
    )
    # Sampled every second (tracking.system_metrics_interval_s=1) while the run ran: a sample
    # holds both metrics under one step, the steps count on one by one, and however slowly a
    # loaded machine samples, there is at most one sample a second of the run.
    run = client.get_run(outcome.run_id)
    run_s = (run.info.end_time - run.info.start_time) / 1000
    for node in {rank["node"] for rank in placement["ranks"]}:
        history = client.get_metric_history(
            outcome.run_id, f"system/{node}/cpu_utilization_percentage"
        )
        assert all(0 <= m.value <= 100 for m in history), history
        memory = client.get_metric_history(
            outcome.run_id, f"system/{node}/system_memory_usage_megabytes"
        )
        assert all(m.value > 100 for m in memory), memory
        assert 1 <= len(history) <= run_s + 1, (len(history), run_s)
        steps = sorted(m.step for m in history)
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps
        assert steps == sorted(m.step for m in memory), (steps, memory)
        assert all(m.timestamp >= run.info.start_time for m in history), history
