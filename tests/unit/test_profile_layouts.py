"""Which blocks the profile times as the sharded layouts wrap them, and on which workers."""

from raylane.config.dims import ParallelDims
from raylane.plan.wrapped import wrap_dims, wrap_name


def test_a_level_times_the_sharded_blocks_of_its_layouts_on_its_first_workers():
    assert set(wrap_dims(4, 4)) == {"fsdp4", "fsdp2", "tp2", "fsdp2_tp2"}
    assert set(wrap_dims(4, 2)) == {"fsdp2", "tp2"}
    assert wrap_dims(4, 1) == {} and wrap_dims(4, 3) == {}
    # A sequence that splits over 2 ring workers: the block under ring attention too.
    assert set(wrap_dims(4, 2, ring=True)) == {"fsdp2", "tp2", "cp2"}
    for k in (2, 4):
        for name, dims in wrap_dims(4, k, ring=True).items():
            assert dims.world_size == 4  # every rank builds the mesh
            assert wrap_name(dims) == name
            # The groups the first k ranks form are complete among themselves: they sit in
            # the first replica(s) of the layout's shape.
            replicas = {dims.coordinates(rank)["dp_replicate"] for rank in range(k)}
            per_replica = dims.world_size // dims.dp_replicate
            assert len(replicas) * per_replica == k


def test_a_layout_names_the_block_it_is_predicted_from():
    assert wrap_name(ParallelDims(dp_shard=2, pp=2)) == "fsdp2"  # pipeline stages, sharded
    assert wrap_name(ParallelDims(dp_replicate=2, tp=2)) == "tp2"
    assert wrap_name(ParallelDims(dp_shard=2, tp=2)) == "fsdp2_tp2"
    assert wrap_name(ParallelDims(dp_replicate=4)) is None  # data parallel: the plain block
    assert wrap_name(ParallelDims(dp_replicate=2, cp=2)) == "cp2"  # ring attention
    assert wrap_name(ParallelDims(dp_replicate=1, cp=2)) == "cp2"
    assert wrap_name(ParallelDims(dp_replicate=2, tp=2, cp=2)) is None  # ring x tp: plain block


def test_a_model_whose_heads_do_not_split_in_two_is_not_timed_tensor_parallel():
    assert set(wrap_dims(4, 4, splits=False)) == {"fsdp4", "fsdp2"}
