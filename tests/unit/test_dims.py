"""The layout type every strategy name resolves to (raylane.config.dims)."""

import re

import pytest
import torch

from raylane.config import ConfigError, RaylaneConfig, load_config
from raylane.config.dims import MESH_DIMS, ParallelDims, Sync

from .test_config import REFERENCE, ROOT

LM = "configs/train/lm_pipeline.yaml"


def _dims(config, *overrides):
    return load_config(config, list(overrides)).parallelism.dims


@pytest.mark.parametrize(
    ("config", "overrides", "degrees", "sync"),
    [
        (REFERENCE, [], (2, 1, 1, 1, 1), Sync()),
        (REFERENCE, ["parallelism.grad_compression=fp16"], (2, 1, 1, 1, 1),
         Sync(compression="fp16")),
        (REFERENCE, ["parallelism.strategy=local_sgd", "parallelism.local_sgd_period=3"],
         (2, 1, 1, 1, 1), Sync("periodic_average", period=3)),
        (REFERENCE, ["parallelism.strategy=async"], (2, 1, 1, 1, 1),
         Sync("parameter_server", staleness=None, shards=2)),
        (REFERENCE, ["parallelism.strategy=ssp", "parallelism.staleness=3"], (2, 1, 1, 1, 1),
         Sync("parameter_server", staleness=3, shards=2)),
        (LM, [], (1, 1, 2, 1, 1), Sync()),
        (LM, ["parallelism.strategy=hybrid", "parallelism.workers=4", "parallelism.dp=2"],
         (2, 1, 2, 1, 1), Sync()),
        (LM, ["parallelism.strategy=hybrid", "parallelism.workers=8", "parallelism.dp=2",
              "parallelism.tp=2"], (2, 1, 2, 1, 2), Sync()),
        ("configs/train/lm_tp.yaml", [], (1, 1, 1, 1, 2), Sync()),
        ("configs/train/lm_tp.yaml", ["parallelism.workers=4"], (2, 1, 1, 1, 2), Sync()),
        ("configs/train/lm_tp.yaml", ["parallelism.workers=4", "parallelism.grad_compression=topk"],
         (2, 1, 1, 1, 2), Sync(compression="topk")),
        ("configs/train/lm_fsdp.yaml", [], (1, 2, 1, 1, 1), Sync()),
        ("configs/train/lm_fsdp.yaml", ["parallelism.workers=4", "parallelism.tp=2"],
         (1, 2, 1, 1, 2), Sync()),
    ],
)  # fmt: skip
def test_every_strategy_name_is_a_preset_of_one_layout(config, overrides, degrees, sync):
    cfg = load_config(config, overrides)
    dims = cfg.parallelism.dims
    assert dims.mesh_shape() == degrees
    assert dims.sync == sync
    assert dims.world_size == cfg.parallelism.workers


@pytest.mark.parametrize(
    ("config", "named", "degrees"),
    [
        (REFERENCE, [], []),
        (REFERENCE, ["parallelism.grad_compression=fp16"],
         ["parallelism.sync={compression: fp16}"]),
        (REFERENCE, ["parallelism.strategy=local_sgd", "parallelism.local_sgd_period=3"],
         ["parallelism.sync={kind: periodic_average, period: 3}"]),
        (REFERENCE, ["parallelism.strategy=async"], ["parallelism.sync={kind: parameter_server}"]),
        (REFERENCE, ["parallelism.strategy=ssp", "parallelism.staleness=3"],
         ["parallelism.sync={kind: parameter_server, staleness: 3}"]),
        (LM, [], []),
        (LM, ["parallelism.strategy=hybrid", "parallelism.workers=8", "parallelism.dp=2",
              "parallelism.tp=2"],
         ["parallelism.workers=8", "parallelism.dp=2", "parallelism.tp=2"]),
        ("configs/train/lm_tp.yaml", ["parallelism.workers=4"], ["parallelism.workers=4"]),
        ("configs/train/lm_fsdp.yaml", [], ["parallelism.dp_shard=2"]),
        ("configs/train/lm_fsdp.yaml", ["parallelism.workers=4", "parallelism.tp=2"],
         ["parallelism.workers=4", "parallelism.tp=2", "parallelism.dp_shard=2"]),
        (LM, ["parallelism.strategy=fsdp", "parallelism.workers=4", "parallelism.dp=2"],
         ["parallelism.workers=4", "parallelism.dp_shard=2"]),
    ],
)  # fmt: skip
def test_a_layout_given_by_its_degrees_is_the_named_one(config, named, degrees):
    by_name = load_config(config, named).parallelism
    by_degrees = load_config(config, ["parallelism.strategy=null", *degrees]).parallelism
    assert by_degrees.dims == by_name.dims
    assert by_degrees.strategy == by_name.strategy
    assert by_degrees.dims.world_size == by_degrees.workers


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.strategy=ddp", "parallelism.dp_shard=2"],
         "strategy 'ddp' is not the layout its degrees make (dp_shard 2 (2 workers): gradients "
         "reduce-scattered: 'fsdp'); give one or the other"),
        (["parallelism.dp_shard=2", "parallelism.workers=8", "parallelism.tp=2"],
         "dp 2 replicas of dp_shard 2 shards (HSDP) with pipeline stages, tensor or context "
         "parallelism is not available yet"),
        (["parallelism.dp_shard=2", "parallelism.workers=4",
          "parallelism.sync={kind: all_reduce, compression: fp16}"],
         "synchronises by FSDP2's own reduce-scatter and all-reduce: sync all_reduce with "
         "compression fp16 is not available with it"),
        (["parallelism.dp_shard=2", "parallelism.workers={min: 2, max: 4}"],
         "(HSDP) runs at a fixed size: give workers as one number"),
        (["parallelism.dp_shard=3"], "workers (2) is not divisible by dp_shard * pp * tp * cp (3)"),
        (["parallelism.sync={kind: gossip}"], "parallelism.sync.kind: Input should be"),
    ],
)  # fmt: skip
def test_degrees_that_make_no_layout_or_another_name_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(REFERENCE, overrides)


def test_hsdp_is_replicas_of_a_sharded_model_given_by_its_degrees():
    hsdp = ["parallelism.strategy=fsdp", "parallelism.dp_shard=2", "parallelism.workers=4"]
    cfg = load_config(REFERENCE, hsdp)
    dims = cfg.parallelism.dims
    assert (dims.dp_replicate, dims.dp_shard, dims.world_size) == (2, 2, 4)
    assert cfg.parallelism.strategy == "fsdp" and cfg.parallelism.dp == 4
    assert dims.describe() == (
        "dp 2 x dp_shard 2 (4 workers): gradients reduce-scattered, shards all-reduced over "
        "the replicas"
    )
    # Rank r trains on part r of each global batch: replicas in the outer dimension.
    assert [dims.data_rank(rank) for rank in range(4)] == [0, 1, 2, 3]
    assert [dims.coordinates(rank)["dp_replicate"] for rank in range(4)] == [0, 0, 1, 1]
    # Stages sharded by their degrees (dp counts a stage's shards) survive a worker's or
    # `raylane reproduce`'s revalidation of the dumped config.
    stages = load_config(
        ROOT / "configs" / "train" / "lm_fsdp.yaml",
        ["parallelism.workers=4", "parallelism.dp_shard=2", "parallelism.pp=2",
         "parallelism.microbatches=2"],
    )  # fmt: skip
    again = RaylaneConfig.model_validate(stages.model_dump(mode="json"))
    assert again.parallelism.dims == stages.parallelism.dims
    assert (stages.parallelism.dims.dp_replicate, stages.parallelism.dims.dp_shard) == (1, 2)
    # Plain FSDP over all the workers is still the strategy's own layout.
    whole = load_config(REFERENCE, ["parallelism.strategy=fsdp", "parallelism.workers=4"])
    assert (whole.parallelism.dims.dp_replicate, whole.parallelism.dims.dp_shard) == (1, 4)


def test_coordinates_are_the_meshs_row_major_order():
    dims = ParallelDims(dp_replicate=2, dp_shard=1, pp=2, tp=2)
    grid = torch.arange(dims.world_size).view(dims.mesh_shape())
    for rank in range(dims.world_size):
        where = dims.coordinates(rank)
        assert grid[tuple(where[name] for name in MESH_DIMS)].item() == rank
    # A tensor-parallel group is neighbouring ranks, then the stages, then the replicas.
    assert dims.coordinates(5) == {"dp_replicate": 1, "dp_shard": 0, "pp": 0, "cp": 0, "tp": 1}
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    hsdp = ParallelDims(dp_replicate=2, dp_shard=3)
    assert [hsdp.data_rank(r) for r in range(6)] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="rank 8 is outside a layout of 8 workers"):
        dims.coordinates(8)


def test_layout_describes_itself_and_names_impossible_degrees():
    assert _dims(REFERENCE).describe() == "dp 2 (2 workers): gradients all-reduced"
    three_d = _dims(LM, "parallelism.strategy=hybrid", "parallelism.workers=8",
                    "parallelism.dp=2", "parallelism.tp=2")  # fmt: skip
    assert three_d.describe() == "dp 2 x pp 2 x tp 2 (8 workers): gradients all-reduced"
    assert _dims(LM).describe() == "pp 2 (2 workers)"
    sharded_stages = _dims(LM, "parallelism.strategy=fsdp", "parallelism.workers=4",
                           "parallelism.dp=2", "parallelism.microbatches=4")  # fmt: skip
    assert (sharded_stages.dp_shard, sharded_stages.pp, sharded_stages.dp_replicate) == (2, 2, 1)
    assert sharded_stages.describe() == "dp_shard 2 x pp 2 (4 workers): gradients reduce-scattered"
    assert _dims(REFERENCE, "parallelism.workers=1").describe() == "1 worker"
    ssp = _dims(REFERENCE, "parallelism.strategy=ssp")
    assert ssp.describe() == "dp 2 (2 workers): parameter server on 2 shards, staleness at most 2"
    assert ssp.as_params() == {
        "layout.dp_replicate": "2", "layout.dp_shard": "1", "layout.pp": "1", "layout.tp": "1",
        "layout.cp": "1", "layout.sync": "parameter_server", "layout.sequence_parallel": "false",
    }  # fmt: skip
    sequence = _dims(LM, "parallelism.strategy=tp", "parallelism.pp=1", "parallelism.tp=2",
                     "parallelism.sequence_parallel=true")  # fmt: skip
    assert sequence.describe() == "tp 2 (sequence-parallel) (2 workers)"
    with pytest.raises(ValueError, match="layout: tp must be at least 1"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="sequence parallelism .* it needs tp > 1"):
        ParallelDims(sequence_parallel=True)
    with pytest.raises(ValueError, match="context parallelism .* not yet with FSDP or pipeline"):
        ParallelDims(cp=2, dp_shard=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.strategy=fsdp", "parallelism.cp=2", "parallelism.workers=4",
          "parallelism.pp=1"], "splits sequences over workers of a 'ddp' or 'tp' layout"),
        (["parallelism.strategy=ddp", "parallelism.cp=3", "parallelism.workers=3",
          "parallelism.pp=1"], "cuts each sequence into 2 * cp = 6 equal chunks"),
        (["parallelism.strategy=ddp", "parallelism.cp=2", "parallelism.workers=3",
          "parallelism.pp=1"], "workers (3) is not divisible by cp (2)"),
        (["parallelism.strategy=ddp", "parallelism.cp=2", "parallelism.workers=4",
          "parallelism.pp=1", "parallelism.grad_compression=powersgd"],
         "with cp > 1 the replicas and cp workers average one buffer"),
        (["parallelism.strategy=tp", "parallelism.cp=2", "parallelism.tp=4",
          "parallelism.workers=8", "parallelism.pp=1", "parallelism.sequence_parallel=true",
          "model.input_dim=12", "model.n_heads=4"],
         "cuts each worker's 6 tokens (model.input_dim / cp) into tp (4) equal parts"),
        (["parallelism.strategy=tp", "parallelism.tp=2", "parallelism.workers=2",
          "parallelism.pp=1", "parallelism.sequence_parallel=true", "model.num_classes=255"],
         "splits the head's 255 classes (model.num_classes) over tp (2) workers"),
    ],
)  # fmt: skip
def test_context_parallel_layouts_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(LM, overrides)


def test_a_context_parallel_layout_splits_the_sequence_and_keeps_the_replicas():
    dims = _dims(LM, "parallelism.strategy=ddp", "parallelism.cp=2", "parallelism.workers=4",
                 "parallelism.pp=1")  # fmt: skip
    assert (dims.dp_replicate, dims.cp, dims.world_size) == (2, 2, 4)
    assert dims.describe() == "dp 2 x cp 2 (4 workers): gradients all-reduced"
    # The two workers of one replica read the same rows: their data rank is the replica's.
    assert [dims.data_rank(r) for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("config", "overrides", "trains_on"),
    [
        (REFERENCE, [], "ddp:DataParallel"),
        (REFERENCE, ["parallelism.strategy=null", "parallelism.sync={kind: periodic_average}"],
         "local_sgd:LocalSGD"),
        (REFERENCE, ["parallelism.strategy=ssp"], "async_sgd:ParameterServerTraining"),
        (LM, [], "pipeline:PipelineParallel"),
        (LM, ["parallelism.strategy=fsdp", "parallelism.workers=4", "parallelism.dp=2"],
         "pipeline:PipelineParallel"),
        ("configs/train/lm_tp.yaml", [], "mesh_parallel:MeshParallel"),
        ("configs/train/lm_fsdp.yaml", [], "mesh_parallel:MeshParallel"),
        # one worker of an elastic FSDP range reads its batches as the sharded group does
        ("configs/train/lm_fsdp.yaml", ["parallelism.workers=1"], "mesh_parallel:MeshParallel"),
        (LM, ["parallelism.strategy=ddp", "parallelism.pp=1", "parallelism.cp=2"],
         "mesh_parallel:MeshParallel"),
    ],
)  # fmt: skip
def test_what_trains_a_layout_follows_its_degrees_and_sync(config, overrides, trains_on):
    from raylane.parallel.registry import implementation

    par = load_config(config, overrides).parallelism
    assert implementation(par) == f"raylane.parallel.{trains_on}"
