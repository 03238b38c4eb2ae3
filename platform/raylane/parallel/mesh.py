"""Named device meshes: `dp` replicas x `pp` stages x `tp` tensor-parallel workers (pipelined
jobs, 3D when tp > 1), `dp` x `tp` (tensor-parallel and sharded jobs)."""

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
    """Where this worker sits: global rank = (dp_rank * pp + pp_rank) * tp + tp_rank."""

    mesh: DeviceMesh
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    tp: int = 1
    tp_rank: int = 0

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh[MeshDim.DP.value].get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh[MeshDim.PP.value].get_group()

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[MeshDim.TP.value]


def build_mesh(dp: int, pp: int, device_type: str, tp: int = 1) -> ParallelMesh:
    """A (dp, pp, tp) mesh over the process group Ray Train already initialised: the workers
    of one tensor-parallel group are neighbours, then the stages, then the replicas."""
    mesh = init_device_mesh(
        device_type, (dp, pp, tp), mesh_dim_names=(MeshDim.DP, MeshDim.PP, MeshDim.TP)
    )
    return ParallelMesh(
        mesh=mesh,
        dp=dp,
        pp=pp,
        dp_rank=mesh.get_local_rank(MeshDim.DP.value),
        pp_rank=mesh.get_local_rank(MeshDim.PP.value),
        tp=tp,
        tp_rank=mesh.get_local_rank(MeshDim.TP.value),
    )


def build_dp_tp_mesh(dp: int, tp: int, device_type: str) -> DeviceMesh:
    """A (dp, tp) mesh: global rank = dp_rank * tp + tp_rank, so a tensor-parallel group is
    neighbouring ranks (on one node when a node holds a multiple of tp workers)."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=(MeshDim.DP, MeshDim.TP))
