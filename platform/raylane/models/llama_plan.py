"""How the Llama of `raylane.models.llama` splits over tensor-parallel workers: the GPT's
Megatron plan (`raylane.models.gpt_plan`) on Hugging Face's module names.

In every block the query, key and value projections and the SwiGLU's gate and up linears are
split column-wise, the attention output and the down linear row-wise (their partial sums
all-reduced). Each of the `tp` workers holds n_heads / tp whole query heads, n_kv_heads / tp
whole key/value heads (a query head's group lands with its key/value head, as the heads are
laid out group by group) and ffn_dim / tp hidden units; the attention reads its local number
of heads from the projections' outputs. With sequence parallelism the two RMSNorms and the
residual adds work on sequence shards and the column-wise linears keep only their input's
shard (`gpt_plan.SequenceGathered`); the block boundary and the model's end are the GPT's
(`gpt_plan.block_io`, `gpt_plan.head_plan`), the block's rotary angles passed through whole.
Qwen3's per-head query and key norms see only the worker's heads: their weights are replicated
DTensors over the heads' shards (torch's `SequenceParallel` on the heads dimension), so each
weight's gradient, partial on every worker, is summed over the tensor-parallel group.
Imported only where tensor parallelism is applied, as the GPT's plan is.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from raylane.models import gpt_plan
from raylane.models.gpt_plan import SequenceGathered, head_plan

__all__ = ["block_io", "block_plan", "head_plan"]
#: Qwen3's per-head norms (a plan entry the parallelizer leaves out where a block has none).
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def block_plan(sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """How one `raylane.models.llama.LlamaBlock` is split: module name -> style. With
    `sequence_parallel`, the norms work on the block's sequence shards (`block_io`) and the
    column-wise linears keep only those shards for backward (`SequenceGathered`)."""
    # [B, T, heads, head_dim]: a worker's heads are its shard of dimension 2.
    head_norms = {
        name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in QK_NORMS
    }
    if not sequence_parallel:
        columns, rows = ColwiseParallel, RowwiseParallel
        return {
            **head_norms,
            "self_attn.q_proj": columns(),
            "self_attn.k_proj": columns(),
            "self_attn.v_proj": columns(),
            "self_attn.o_proj": rows(),
            "mlp.gate_proj": columns(),
            "mlp.up_proj": columns(),
            "mlp.down_proj": rows(),
        }
    from torch.distributed.tensor import Shard

    scattered = {"output_layouts": Shard(1), "use_local_output": False}  # reduce-scatter
    return {
        **head_norms,
        "input_layernorm": SequenceParallel(),
        "self_attn.q_proj": SequenceGathered(),
        "self_attn.k_proj": SequenceGathered(),
        "self_attn.v_proj": SequenceGathered(),
        "self_attn.o_proj": RowwiseParallel(**scattered),
        "post_attention_layernorm": SequenceParallel(),
        "mlp.gate_proj": SequenceGathered(),
        "mlp.up_proj": SequenceGathered(),
        "mlp.down_proj": RowwiseParallel(**scattered),
    }


def block_io(last: bool = False) -> ParallelStyle:
    """The GPT's sequence-parallel block boundary for a block called as `block(x, cos, sin)`:
    `x` is cut along the sequence, the rotary angles (the whole sequence's) pass unchanged."""
    return gpt_plan.block_io(last, inputs=3)
