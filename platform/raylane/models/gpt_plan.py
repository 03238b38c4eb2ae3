"""How the GPT of `raylane.models.gpt` splits over tensor-parallel workers: its plan, kept
beside the model whose module names it uses (a new model brings its own plan; the parallel
layer applies whichever plan the model has).

Megatron style: in every block the query, key and value projections and the MLP's first linear
are split column-wise (each of the `tp` workers holds n_heads / tp whole heads and 4·d / tp
hidden units) and the attention output and the MLP's second linear row-wise, whose partial sums
are all-reduced: one all-reduce per half-block forward, one backward. Embeddings, norms and the
head stay replicated (but see sequence parallelism below).

With sequence parallelism (Korthikanti et al. 2022) the regions between those matmuls, the
two LayerNorms and the residual adds, work on 1 / tp of the sequence instead of all of it on
every worker: each all-reduce becomes a reduce-scatter (to sequence shards) plus an all-gather
(before the next column-wise matmul), the same bytes. As in Megatron, a column-wise matmul
keeps only its input's shard for backward and gathers the sequence again there
(`SequenceGathered`), and a whole model's end works on shards too: the final norm on the
sequence, the head over the vocabulary with torch's `loss_parallel` (`head_plan`). What the
blocks and the end keep for backward shrinks by about tp, for a second all-gather per
column-wise matmul in backward. Imported only where tensor parallelism is applied (DTensor's
imports cost a worker seconds that a data-parallel run never pays).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn import functional as F


def block_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """How one `raylane.models.gpt.Block` is split: module name -> style. With
    `sequence_parallel`, the norms work on the block's sequence shards (`block_io` below) and
    the column-wise linears keep only those shards for backward (`SequenceGathered`)."""
    if not sequence_parallel:
        return {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(),
        }
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    scattered = {"output_layouts": Shard(1), "use_local_output": False}  # reduce-scatter
    return {
        "ln1": SequenceParallel(),
        "attn.q": SequenceGathered(),
        "attn.k": SequenceGathered(),
        "attn.v": SequenceGathered(),
        "attn.proj": RowwiseParallel(**scattered),
        "ln2": SequenceParallel(),
        "mlp.0": SequenceGathered(),
        "mlp.2": RowwiseParallel(**scattered),
    }


def head_plan() -> dict[str, ParallelStyle]:
    """The model's end under sequence parallelism, for a loss computed with torch's
    `loss_parallel`: the final norm on sequence shards, the head split over the vocabulary
    (each worker's logits are its 1 / tp of the classes for every position, the input's shard
    kept for backward), so neither the head's input nor the logits and their softmax are held
    whole by any worker. The last block leaves its output on sequence shards for the norm
    (`block_io(last=True)`)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return {"norm": SequenceParallel(), "head": SequenceGathered(vocabulary_output=True)}


def block_io(last: bool = False, inputs: int = 1) -> ParallelStyle:
    """Sequence parallelism's block boundary: the block's input (replicated, as the previous
    block or the embedding leaves it) is cut along the sequence, so the norms, residual adds and
    their saved activations hold T / tp positions; its output is gathered back, except after
    the `last` block when the model's end works on the shards too (`head_plan`). A block taking
    more than one positional input (`inputs`) gets the others unchanged."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    unchanged = (None,) * (inputs - 1)
    return PrepareModuleInputOutput(
        input_layouts=(Replicate(), *unchanged),
        desired_input_layouts=(Shard(1), *unchanged),
        use_local_input=False,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Shard(1),) if last else (Replicate(),),
        use_local_output=not last,
    )


class SequenceGathered(ColwiseParallel):
    """A column-wise linear whose input arrives as this worker's sequence shard (Megatron's
    sequence parallelism): the shards are all-gathered for the matmul, but backward keeps only
    this worker's shard and gathers it again when it needs the whole input (for the weight's
    gradient), where torch's `ColwiseParallel(input_layouts=Shard(1))` keeps the gathered
    input: tp times the bytes, for each of q, k, v and the MLP's first linear. The input's
    gradient is reduce-scattered back to the shards. The weight is split by output columns
    as `ColwiseParallel` splits it (checkpoints and FSDP see the same DTensors)."""

    def __init__(self, vocabulary_output: bool = False):
        super().__init__()
        self.vocabulary_output = vocabulary_output

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import distribute_module

        if type(module) is not nn.Linear:
            raise NotImplementedError(f"SequenceGathered splits an nn.Linear, not {module!r}")
        distribute_module(module, device_mesh, self._partition_linear_fn)
        module.__class__ = _SequenceGatheredLinear
        module.vocabulary_output = self.vocabulary_output
        return module


class _SequenceGatheredLinear(nn.Linear):
    """An `nn.Linear` split by `SequenceGathered`: takes this worker's sequence shard (a DTensor
    is first moved to the sequence placement), returns its output columns for every position
    (a plain tensor, or a DTensor sharded on the last dimension with `vocabulary_output`)."""

    vocabulary_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        mesh = self.weight.device_mesh
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, [Shard(1)]).to_local()
        bias = self.bias.to_local() if self.bias is not None else None
        out = _GatheredLinear.apply(x, self.weight.to_local(), bias, mesh)
        if self.vocabulary_output:
            return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)
        return out


class _GatheredLinear(torch.autograd.Function):
    """y = all_gather(shard) @ w.T + b, saving the shard (not the gathered input) for backward.
    Under autocast the shard is cast to the autocast dtype first, as the matmul would cast its
    input: it is gathered and kept in bf16, as torch's own linear keeps its input."""

    @staticmethod
    def forward(ctx, shard, weight, bias, mesh):
        ctx.mesh, ctx.has_bias, ctx.input_dtype = mesh, bias is not None, shard.dtype
        device = shard.device.type
        if torch.is_autocast_enabled(device):
            shard = shard.to(torch.get_autocast_dtype(device))
        ctx.save_for_backward(shard)
        ctx.weight = weight  # a parameter's shard, not an activation: not saved as one
        return F.linear(_gather(shard, mesh), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (shard,) = ctx.saved_tensors
        weight = ctx.weight
        grad_shard = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:  # the weight's gradient needs the whole input again
            whole = _gather(shard, ctx.mesh).to(grad.dtype)
            rows = grad.reshape(-1, grad.shape[-1])
            grad_weight = (rows.T @ whole.reshape(-1, whole.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:  # summed over the workers in the input's own dtype
            grad_whole = (grad @ weight.to(grad.dtype)).to(ctx.input_dtype)
            grad_shard = _scatter(grad_whole, ctx.mesh)
        return grad_shard, grad_weight, grad_bias, None


def _gather(shard: torch.Tensor, mesh) -> torch.Tensor:
    """The whole sequence from every worker's shard of dimension 1 (an all-gather)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(shard, mesh, [Shard(1)], run_check=False).full_tensor()


def _scatter(partial: torch.Tensor, mesh) -> torch.Tensor:
    """This worker's sequence shard of the sum of every worker's `partial` (a reduce-scatter)."""
    from torch.distributed._functional_collectives import wait_tensor
    from torch.distributed.tensor import DTensor, Partial, Shard

    summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
    return wait_tensor(summed.redistribute(mesh, [Shard(1)]).to_local())
