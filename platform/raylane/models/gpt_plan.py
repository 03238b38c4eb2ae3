"""How the GPT of `raylane.models.gpt` splits over tensor-parallel workers: its plan, kept
beside the model whose module names it uses (a new model brings its own plan; the parallel
layer applies whichever plan the model has).

Megatron style: in every block the query, key and value projections and the MLP's first linear
are split column-wise (each of the `tp` workers holds n_heads / tp whole heads and 4·d / tp
hidden units) and the attention output and the MLP's second linear row-wise, whose partial sums
are all-reduced: one all-reduce per half-block forward, one backward. Embeddings, norms and the
head stay replicated.

With sequence parallelism (Korthikanti et al. 2022) the regions between those matmuls, the
two LayerNorms and the residual adds, work on 1 / tp of the sequence instead of all of it on
every worker: each all-reduce becomes a reduce-scatter (to sequence shards) plus an all-gather
(before the next column-wise matmul), the same bytes, and the activations those regions keep
for backward shrink by tp. Imported only where tensor parallelism is applied (DTensor's imports cost
a worker seconds that a data-parallel run never pays).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def block_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """How one `raylane.models.gpt.Block` is split: module name -> style. With
    `sequence_parallel`, the norms work on the block's sequence shards (`block_io` below)."""
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

    gathered = {"input_layouts": Shard(1)}  # all-gather the sequence before the matmul
    scattered = {"output_layouts": Shard(1), "use_local_output": False}  # reduce-scatter
    return {
        "ln1": SequenceParallel(),
        "attn.q": ColwiseParallel(**gathered),
        "attn.k": ColwiseParallel(**gathered),
        "attn.v": ColwiseParallel(**gathered),
        "attn.proj": RowwiseParallel(**scattered),
        "ln2": SequenceParallel(),
        "mlp.0": ColwiseParallel(**gathered),
        "mlp.2": RowwiseParallel(**scattered),
    }


def block_io() -> ParallelStyle:
    """Sequence parallelism's block boundary: the block's input (replicated, as the previous
    block or the embedding leaves it) is cut along the sequence, so the norms, residual adds and
    their saved activations hold T / tp positions; its output is gathered back."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(
        input_layouts=(Replicate(),),
        desired_input_layouts=(Shard(1),),
        use_local_input=False,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Replicate(),),
        use_local_output=True,
    )
