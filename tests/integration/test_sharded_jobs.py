"""Model-splitting layouts through the product's own path (`run_training`: the loop's routing
of rows to replicas and stages, the configured optimizer, MLflow): each trains what one worker
trains on the same global batches; tensor-parallel and FSDP runs checkpoint sharded, a 3D run
resumes to the uninterrupted result (as a context-parallel run does, and HSDP's checkpoint
re-sharded onto one FSDP worker), runs record per-worker memory, and their assembled model is
registered whole and loads as the inference endpoint loads it (a served pipeline model
answers over HTTP in test_pipeline_jobs.py). The layouts with pipeline stages
read their rows through Ray Data (`data.feed: ray_data`), the others from the object store
(the memory feed): both feeds must hand every stage and replica its rows of the same batches.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint import FileSystemReader

from raylane.config import load_config
from raylane.config.layout import replicas
from raylane.data.parquet import read_rows
from raylane.serving.inference.predictor import Predictor
from raylane.tracking.identity import weights_digest
from raylane.train.job import run_training

from .conftest import ROOT, lm_overrides

STEPS = 3
# Every run's global batch: each replica of a layout takes its slice, so one 1-worker run of
# GLOBAL_ROWS rows a step is the reference for every layout.
GLOBAL_ROWS = 16
REGISTERED = {"3d", "fsdp-tp"}  # the layouts whose registered model a test reads

# Pipeline and hybrid alone are the 3D layout without tp: their schedules are checked step by
# step in test_layout_equivalence.py, and a pp=2 run through this path in test_pipeline_jobs.py.
LAYOUTS = {
    # With sequence parallelism: its loss comes from `loss_parallel` (a vocabulary-split head),
    # summed by the loop like any other (plain tp runs through this path in the README's
    # lm_tp.yaml block).
    "tp-sp": [
        "parallelism.strategy=tp",
        "parallelism.pp=1",
        "parallelism.tp=2",
        "parallelism.sequence_parallel=true",
    ],
    # HSDP: 2 replicas of the model, each sharded over 2 workers (given by its degrees). Plain
    # FSDP trains through this path in the README's lm_fsdp.yaml block, and below onto one
    # worker from HSDP's checkpoint.
    "hsdp": ["parallelism.strategy=fsdp", "parallelism.pp=1", "parallelism.dp_shard=2"],
    "fsdp-tp": [
        "parallelism.strategy=fsdp",
        "parallelism.pp=1",
        "parallelism.dp=2",
        "parallelism.tp=2",
    ],
}
# Stages read the same rows, whole (Ray Data does not shard them): each stage keeps its
# replica's slice of every global batch.
RAY_DATA = "data.feed=ray_data"
LAYOUTS["3d"] = [
    "parallelism.strategy=hybrid",
    "parallelism.pp=2",
    "parallelism.dp=2",
    "parallelism.tp=2",
    RAY_DATA,
]
# Stages sharded by FSDP2 (pp 2 x fsdp 2) run the 3D run's path (the loop's PipelineParallel:
# the same routing of rows, per-stage parts and DCP shards); what differs is inside the stage's
# parallelisation, checked step by step by test_layout_equivalence.py's pp2-fsdp2 layout.
# Context parallelism: each sequence split over 2 workers (ring attention), their checkpoint
# the plain model rank 0 writes.
LAYOUTS["cp"] = ["parallelism.strategy=ddp", "parallelism.pp=1", "parallelism.dp=1",
                 "parallelism.cp=2"]  # fmt: skip
WORKERS = {"tp-sp": 2, "hsdp": 4, "fsdp-tp": 4, "3d": 8, "cp": 2}
# Layouts only resumed onto (not compared on their own).
RESUMED = {"fsdp": ["parallelism.strategy=fsdp", "parallelism.pp=1"]}


def _config(workspace, *extra: str):
    return load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        lm_overrides(
            workspace,
            "training.epochs=2",
            f"training.steps_per_epoch={STEPS}",
            "parallelism.microbatches=4",
            "parallelism.torch_threads=1",
            "parallelism.resources_per_worker.CPU=0.25",
            "tracking.system_metrics_interval_s=0",
            "tracking.registered_model=raylane-layouts",
            *extra,
        ),
    )


def _losses(workspace, run_id: str) -> list[float]:
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    return [m.value for m in client.get_metric_history(run_id, "train_loss")]


@pytest.fixture(scope="module")
def one_worker(ray_cluster, workspace) -> list[float]:
    """Per-epoch losses of one DDP worker on the global batches every layout reads."""
    cfg = _config(
        workspace,
        "parallelism.strategy=ddp",
        "parallelism.pp=1",
        "parallelism.workers=1",
        f"training.batch_size={GLOBAL_ROWS}",
    )
    return _losses(workspace, run_training(cfg, register=False).run_id)


@pytest.fixture(scope="module")
def layout_runs(ray_cluster, workspace):
    ran = {}

    def run(name: str, *extra: str):
        if (name, extra) not in ran:
            if name in RESUMED:  # `extra` gives its size and batch
                layout, rows = tuple(RESUMED[name]), GLOBAL_ROWS
            else:
                layout = (*LAYOUTS[name], f"parallelism.workers={WORKERS[name]}")
                rows = GLOBAL_ROWS // replicas(_config(workspace, *layout))  # per replica
            cfg = _config(
                workspace,
                *layout,
                f"training.batch_size={rows}",
                f"tracking.registered_model=raylane-{name}",
                *extra,
            )
            ran[name, extra] = (cfg, run_training(cfg, register=name in REGISTERED and not extra))
        return ran[name, extra]

    return run


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_what_one_worker_trains(layout_runs, one_worker, workspace, name):
    cfg, outcome = layout_runs(name)
    assert cfg.training.batch_size * replicas(cfg) == GLOBAL_ROWS
    got = _losses(workspace, outcome.run_id)
    assert len(got) == len(one_worker) == 2
    assert got == pytest.approx(one_worker, rel=1e-4)
    assert got[1] < got[0]  # it trained


def test_3d_checkpoint_holds_each_stages_assembled_part_and_its_shards(layout_runs):
    _, outcome = layout_runs("3d")
    checkpoint = Path(outcome.checkpoint_path)
    assert {"model-part000.pt", "model-part001.pt"} <= {p.name for p in checkpoint.iterdir()}
    assert outcome.model_version is not None  # the parts merged into one registered model
    # Sharded too: a file per worker holding shards no other wrote (dp replicas' copies once).
    # Resuming from such a checkpoint: the 3D resume below.
    assert (checkpoint / "sharded" / ".metadata").is_file()
    # torch DCP's file system writer: one file per rank (`__<rank>_0.distcp`), each with shards
    # no other rank wrote (a tensor the dp replicas share goes to one of them).
    files = sorted(p.name for p in (checkpoint / "sharded").glob("*.distcp"))
    assert files == sorted(f"__{rank}_0.distcp" for rank in range(WORKERS["3d"]))


def test_an_hsdp_run_records_its_layout_and_checkpoints_every_rank(layout_runs, workspace):
    cfg, outcome = layout_runs("hsdp")
    assert (cfg.parallelism.dims.dp_replicate, cfg.parallelism.dims.dp_shard) == (2, 2)
    params = MlflowClient(tracking_uri=workspace.tracking_uri).get_run(outcome.run_id).data.params
    assert (params["layout.dp_replicate"], params["layout.dp_shard"]) == ("2", "2")
    # torch DCP: one file per rank, and a shard the two replicas share written once: the
    # chunks stored of every tensor (parameters, AdamW's moments) add up to it exactly once.
    sharded = Path(outcome.checkpoint_path) / "sharded"
    assert sorted(p.name for p in sharded.glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(WORKERS["hsdp"])
    ]
    stored = FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
    tensors = {name: entry for name, entry in stored.items() if hasattr(entry, "chunks")}
    assert len(tensors) >= 3 * len(_parameter_shapes())
    for name, entry in tensors.items():
        held = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
        assert held == math.prod(entry.size), (name, held, tuple(entry.size))


def test_sharded_layouts_record_what_each_worker_holds(layout_runs, one_worker):
    # `one_worker` first: the session's first run also prepares the data.
    metrics = {name: layout_runs(name)[1].metrics for name in ("tp-sp", "hsdp")}
    for name, found in metrics.items():
        for part in ("param", "grad", "optimizer_state", "activation_peak"):
            assert found[f"worker_{part}_mb"] > 0, (name, part)
    # HSDP, 2 replicas of 2 shards: each worker holds half of every parameter, gradient and
    # both Adam moments (plus Adam's step counters), as FSDP over 2 does.
    hsdp = metrics["hsdp"]
    assert hsdp["worker_grad_mb"] == pytest.approx(hsdp["worker_param_mb"])
    assert hsdp["worker_optimizer_state_mb"] == pytest.approx(2 * hsdp["worker_param_mb"], rel=0.01)
    # Exactly half of every parameter (each one's first dimension is even).
    params = _parameter_shapes()
    whole_mb = sum(math.prod(shape) for shape in params.values()) * 4 / 2**20
    assert hsdp["worker_param_mb"] == pytest.approx(whole_mb / 2, rel=1e-9)
    # Tensor parallel with sequence parallelism (`raylane.models.gpt_plan`): q, k, v and the
    # MLP's first linear column-wise (weight and bias), the attention output and the MLP's
    # second linear row-wise (weight; the bias replicated) and the head over the vocabulary
    # are split in two; embeddings and norms stay whole.
    split = ("attn.q.", "attn.k.", "attn.v.", "mlp.0.", "head.", "attn.proj.weight",
             "mlp.2.weight")  # fmt: skip
    held = sum(
        math.prod(shape) // (2 if any(part in name for part in split) else 1)
        for name, shape in params.items()
    )
    tp = metrics["tp-sp"]
    assert tp["worker_param_mb"] == pytest.approx(held * 4 / 2**20, rel=1e-9)
    assert tp["worker_grad_mb"] == pytest.approx(tp["worker_param_mb"], rel=1e-9)


def _parameter_shapes() -> dict[str, tuple[int, ...]]:
    """The plain model's parameters (fp32) of the layouts' config."""
    from raylane.models import build_model

    model = load_config(ROOT / "configs" / "train" / "lm_pipeline.yaml").model
    return {name: tuple(p.shape) for name, p in build_model(model).named_parameters()}


def test_a_3d_checkpoint_resumes_to_the_uninterrupted_result(layout_runs, workspace):
    """dp x pp x tp: each stage's tensor-parallel shards and Adam moments back from torch DCP
    (the tp-only and FSDP cases are the same load, per stage), each stage's rows again from
    Ray Data."""
    _, uninterrupted = layout_runs("3d")
    # The uninterrupted run's first epoch (the run keeps its last two checkpoints).
    checkpoint = Path(uninterrupted.checkpoint_path).parent / "epoch_0000"
    assert (checkpoint / "sharded" / ".metadata").is_file()
    assert len(list((checkpoint / "sharded").glob("*.distcp"))) == WORKERS["3d"]
    assert {"model-part000.pt", "model-part001.pt"} <= {p.name for p in checkpoint.iterdir()}
    _, resumed = layout_runs("3d", f"training.resume_from={checkpoint}")
    # The resumed run trains epoch 1 only, from epoch 0's weights and Adam moments.
    assert _losses(workspace, resumed.run_id) == pytest.approx(
        _losses(workspace, uninterrupted.run_id)[1:], rel=1e-4
    )


def test_a_context_parallel_checkpoint_resumes_to_the_uninterrupted_result(layout_runs, workspace):
    _, uninterrupted = layout_runs("cp")
    checkpoint = Path(uninterrupted.checkpoint_path).parent / "epoch_0000"
    assert (checkpoint / "model-part000.pt").is_file()  # the whole model, from rank 0
    _, resumed = layout_runs("cp", f"training.resume_from={checkpoint}")
    # Epoch 1 again from epoch 0's weights and Adam moments, each worker on its chunks.
    assert _losses(workspace, resumed.run_id) == pytest.approx(
        _losses(workspace, uninterrupted.run_id)[1:], rel=1e-4
    )


def test_assembled_fsdp_tp_model_is_registered_whole_and_loads_as_served(layout_runs, workspace):
    cfg, outcome = layout_runs("fsdp-tp")
    assert outcome.model_version == 1 and outcome.promoted
    mlflow.set_tracking_uri(workspace.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{cfg.tracking.registered_model}@champion")
    # The whole model, not one worker's shard of it.
    state, width = model.state_dict(), cfg.model.d_model
    assert state["blocks.0.attn.q.weight"].shape == (width, width)
    assert state["blocks.0.mlp.0.weight"].shape == (4 * width, width)
    # Bit for bit the model the run assembled from its shards.
    run = MlflowClient(tracking_uri=workspace.tracking_uri).get_run(outcome.run_id)
    assert weights_digest(state) == run.data.tags["raylane.weights_digest"]
    # The endpoint's loader (Serve's HTTP path is the same for any registered model) answers
    # with the model's own next bytes.
    predictor = Predictor.from_registry(
        workspace.tracking_uri, cfg.tracking.registered_model, cfg.tracking.champion_alias
    )
    assert predictor.card.version == 1
    tokens, _ = read_rows(cfg.data.validation_path, cfg, limit=3)
    logits = predictor.predict(tokens)
    assert logits.shape == (3, cfg.model.num_classes)
    expected = model(torch.from_numpy(tokens))[:, -1, :].argmax(dim=-1).tolist()
    assert logits.argmax(axis=-1).tolist() == expected


def test_a_sharded_checkpoint_resumes_resharded_on_fewer_workers(layout_runs, workspace):
    """What an elastic fsdp group does when it shrinks, from the widest sharding there is: the
    checkpoint HSDP's 4 workers wrote (2 replicas of 2 shards) is loaded re-sharded onto one
    fsdp worker (torch DCP), which takes the whole global batch, and the run goes on as if it
    had kept them all."""
    _, uninterrupted = layout_runs("hsdp")
    checkpoint = Path(uninterrupted.checkpoint_path).parent / "epoch_0000"
    assert len(list((checkpoint / "sharded").glob("*.distcp"))) == WORKERS["hsdp"]
    _, resumed = layout_runs(
        "fsdp",
        f"training.resume_from={checkpoint}",
        "parallelism.workers=1",
        "parallelism.dp=1",
        f"training.batch_size={GLOBAL_ROWS}",
    )
    assert _losses(workspace, resumed.run_id) == pytest.approx(
        _losses(workspace, uninterrupted.run_id)[1:], rel=1e-4
    )
