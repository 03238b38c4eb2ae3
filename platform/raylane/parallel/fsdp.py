"""Sharded data parallelism (ZeRO-3) with FSDP2's `fully_shard`, optionally over tensor-parallel
blocks (2D: `dp` x `tp`).

Each of the `dp` workers holds 1/dp of every parameter, its gradient and its optimizer state.
A block's parameters are all-gathered just before its forward (and again before its backward)
and freed after; gradients are reduce-scattered to their owners. Blocks are sharded one by one
so that only one block's full parameters exist at a time, then the rest of the model (embeddings,
norm, head) as the root unit. With tp > 1 the blocks are first split by the tensor-parallel plan
and FSDP shards each tp shard over the dp workers.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from raylane.parallel.tensor_parallel import TensorParallel, apply_tensor_parallel


def apply_fsdp(model: nn.Module, shard_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (a whole GPT or a pipeline stage of one) over `shard_mesh`, block by block
    and then the rest as the root unit (in place)."""
    for block in getattr(model, "blocks", {}).values():
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


class FullyShardedDataParallel(TensorParallel):
    """FSDP2 over the dp dimension of a (dp, tp) mesh (with pipeline stages the pipeline
    strategy shards each stage with `apply_fsdp`)."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._place()
        model = model.to(self.device)
        if self.tp > 1:
            apply_tensor_parallel(model, self.mesh.tp_mesh)
        return apply_fsdp(model, self.mesh.shard_mesh)

    def sync_gradients(self, model: nn.Module) -> None:
        # FSDP's all-gathers and reduce-scatters run inside forward and backward (overlapped
        # where the backend allows): counted as compute.
        return None
