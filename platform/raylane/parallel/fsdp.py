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
from torch.distributed.fsdp import fully_shard

from raylane.parallel.tensor_parallel import TensorParallel, apply_tensor_parallel


class FullyShardedDataParallel(TensorParallel):
    """FSDP2 over the dp dimension of a (dp, tp) mesh."""

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._place()
        model = model.to(self.device)
        if self.tp > 1:
            apply_tensor_parallel(model, self.mesh.tp_mesh)
        dp_mesh = self.mesh.shard_mesh
        for block in getattr(model, "blocks", {}).values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model

    def sync_gradients(self, model: nn.Module) -> None:
        # FSDP's all-gathers and reduce-scatters run inside forward and backward (overlapped
        # where the backend allows): counted as compute.
        return None
