"""The one device mesh of a layout (`raylane.config.dims.ParallelDims`), and where this worker
sits on it.

Every layout builds the same five named dimensions, `dp_replicate x dp_shard x pp x cp x tp`
(degree 1 where unused), over the process group Ray Train already initialised, so a strategy
asks for the sub-mesh it works on by name instead of building its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from raylane.config.dims import MESH_DIMS, ParallelDims


@dataclass(frozen=True)
class ParallelMesh:
    """The mesh and this worker's coordinates on it."""

    mesh: DeviceMesh
    dims: ParallelDims
    rank: int
    #: Whether the `dp_replicate` replicas synchronise: FSDP's shards all-reduced over them
    #: (HSDP), a split model's replicas' gradients (`replicate_in_backward`). False where the
    #: replicas only fill the world for the mesh (the profile's wrapped blocks, timed on one
    #: group while the rest wait).
    hybrid_shard: bool = True

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def dp_rank(self) -> int:
        """This worker's data-parallel index (replicas and shards together)."""
        return self.dims.data_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data-parallel workers of this worker's stage and tensor-parallel rank."""
        if self.dims.dp_shard == 1:
            return self.mesh["dp_replicate"].get_group()
        if self.dims.dp_replicate == 1:
            return self.mesh["dp_shard"].get_group()
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """The workers holding the other chunks of this worker's sequences."""
        return self.mesh["cp"].get_group()

    @property
    def replicas(self) -> int:
        """Workers holding the same (unsharded) parameters whose gradients average into one
        model's: the `dp_replicate` replicas times the `cp` workers of a sequence's chunks."""
        return self.dims.dp_replicate * self.dims.cp

    @property
    def replica_mesh(self) -> DeviceMesh:
        """Those workers as a 1-D mesh: `dp_replicate`, or with context parallelism
        `dp_replicate x cp` flattened (torch builds it once and returns it again)."""
        if self.dims.cp == 1:
            return self.mesh["dp_replicate"]
        return self.mesh["dp_replicate", "cp"]._flatten("dp_cp")

    @property
    def replica_group(self) -> dist.ProcessGroup:
        """The process group of `replica_mesh`."""
        return self.replica_mesh.get_group()

    @property
    def replicate_in_backward(self) -> bool:
        """Whether the replicas of a split but unsharded model (tensor parallel, pipeline
        stages, context parallel) all-reduce their gradients inside backward, by FSDP2's
        `replicate` (`raylane.parallel.parallelize.apply_data_parallel`): there are
        replicas, they train together, and their sync is the plain all-reduce (a compressed
        one is the strategy's: `raylane.parallel.grad_compression.GroupAverager`)."""
        return self.hybrid_shard and self.dims.replicates_split_model

    @property
    def shard_mesh(self) -> DeviceMesh:
        """What FSDP shards parameters over: `dp_shard`, or for HSDP the 2-D
        `dp_replicate x dp_shard` mesh (FSDP2 shards over its second dimension and all-reduces
        the gradient shards over its first)."""
        if self.hybrid_shard and self.dims.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]


def build_device_mesh(
    dims: ParallelDims, device_type: str, hybrid_shard: bool = True
) -> ParallelMesh:
    """The layout's mesh over the initialised process group (its size must be the layout's);
    `hybrid_shard`: see `ParallelMesh`."""
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"layout {dims.describe()} needs {dims.world_size} workers; the process group has "
            f"{dist.get_world_size()}"
        )
    mesh = init_device_mesh(device_type, dims.mesh_shape(), mesh_dim_names=MESH_DIMS)
    return ParallelMesh(mesh=mesh, dims=dims, rank=dist.get_rank(), hybrid_shard=hybrid_shard)
