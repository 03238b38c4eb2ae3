"""Named device meshes: `dp` replicas x `pp` stages (pipelined jobs), `dp` x `tp` (tensor
parallel and sharded jobs)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshDim(StrEnum):
    DP = "dp"
    PP = "pp"
    TP = "tp"


@dataclass(frozen=True)
class ParallelMesh:
    """Where this worker sits: global rank = dp_rank * pp + pp_rank."""

    mesh: DeviceMesh
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh[MeshDim.DP.value].get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh[MeshDim.PP.value].get_group()


def build_mesh(dp: int, pp: int, device_type: str) -> ParallelMesh:
    """A (dp, pp) mesh over the process group Ray Train already initialised."""
    mesh = init_device_mesh(device_type, (dp, pp), mesh_dim_names=(MeshDim.DP, MeshDim.PP))
    return ParallelMesh(
        mesh=mesh,
        dp=dp,
        pp=pp,
        dp_rank=mesh.get_local_rank(MeshDim.DP.value),
        pp_rank=mesh.get_local_rank(MeshDim.PP.value),
    )


def build_dp_tp_mesh(dp: int, tp: int, device_type: str) -> DeviceMesh:
    """A (dp, tp) mesh: global rank = dp_rank * tp + tp_rank, so a tensor-parallel group is
    neighbouring ranks (on one node when a node holds a multiple of tp workers)."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=(MeshDim.DP, MeshDim.TP))
