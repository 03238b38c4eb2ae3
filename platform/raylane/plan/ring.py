"""Ring attention's communication (context parallelism), as both cost models count it.

Each of a layout's `cp` workers holds 2 of a sequence's 2·cp chunks (T/cp tokens) and, per
attention layer, passes key/value blocks round the ring (`raylane.parallel.ring_attention`):
the forward sends cp - 1 blocks of K and V (2 · rows · T/cp · width values); the backward sends
them again and, as many times, their gradient accumulators: twice the forward's bytes, over
twice its compute. raylane's kernel computes and sends in fp32 whatever the training
precision. A step sends the next block while it computes against the one it holds, so a
step costs max(its compute, its transfer) and what the ring adds to the step is the exposed
part, max(0, transfer - compute), for each of the cp - 1 steps that send.

The compute a transfer hides behind is the attention core of one ring step (QK^T and the
probabilities times V, 4 · rows · T² · width FLOPs per layer forward in Megatron's count): a
rank does 1/cp of it, in cp steps.
"""

from __future__ import annotations

#: Bytes of a key, value or gradient value on the ring: the kernel works in fp32.
RING_VALUE_BYTES = 4


def kv_block_bytes(rows: float, local_tokens: float, width: float) -> float:
    """One ring transfer's bytes: the K and V of `rows` sequences' `local_tokens` tokens, at
    the `width` one rank's heads span (d_model / tp)."""
    return 2 * rows * local_tokens * width * RING_VALUE_BYTES


def ring_passes(recompute: bool) -> int:
    """Forward-equivalents of ring traffic and attention compute per step: the forward, the
    backward (twice: K/V and their gradients) and, with activation checkpointing, the
    recomputed forward."""
    return 4 if recompute else 3


def exposed_ring_s(cp: int, passes: int, transfer_s: float, step_compute_s: float) -> float:
    """Seconds one attention layer's ring adds to a step: per pass, cp - 1 steps that each
    send one block (`transfer_s`) while computing against another (`step_compute_s`)."""
    if cp <= 1:
        return 0.0
    return passes * (cp - 1) * max(transfer_s - step_compute_s, 0.0)


def attention_core_share(tokens: float, width: float) -> float:
    """The share of a block's FLOPs in its attention core at a sequence of `tokens` (Megatron's
    24·b·s·h²·(1 + s/6h): the s/6h term), what one ring step's transfer can hide behind."""
    ratio = tokens / (6 * width)
    return ratio / (1 + ratio)
