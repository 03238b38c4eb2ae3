"""The named device mesh of a pipelined job: `dp` replicas x `pp` stages."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshDim(StrEnum):
    DP = "dp"
    PP = "pp"


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
