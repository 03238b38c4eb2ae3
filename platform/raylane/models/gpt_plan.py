"""How the GPT of `raylane.models.gpt` splits over tensor-parallel workers: its plan, kept
beside the model whose module names it uses (a new model brings its own plan; the parallel
layer applies whichever plan the model has).

Megatron style: in every block the query, key and value projections and the MLP's first linear
are split column-wise (each of the `tp` workers holds n_heads / tp whole heads and 4·d / tp
hidden units) and the attention output and the MLP's second linear row-wise, whose partial sums
are all-reduced: one all-reduce per half-block forward, one backward. Embeddings, norms and the
head stay replicated. Imported only where tensor parallelism is applied (DTensor's imports cost
a worker seconds that a data-parallel run never pays).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def block_plan() -> dict[str, ParallelStyle]:
    """How one `raylane.models.gpt.Block` is split: module name -> style."""
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
