"""Exact causal attention over a sequence split across ranks: ring attention (Liu et al. 2023)
for context parallelism.

Each of the N ranks of a group holds a part of every sequence (queries, keys and values of its
own tokens). `ring_attention` computes softmax attention of the local queries against *all*
keys of the sequence, causally masked, without any rank ever holding the whole sequence: the
key/value blocks travel round the ring (rank r sends to r+1 and receives from r-1), and each
step's partial result is merged into a running output by its log-sum-exp, in fp32. The result
equals `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on the whole sequence, for
this rank's rows. The backward recomputes each block's probabilities from q, k and the saved
log-sum-exp; dq accumulates locally, while dk/dv accumulators travel round the ring after
their k/v and arrive at their home rank after the last step.

Zig-zag assignment (torchtitan's and Megatron's load balancing): the sequence of length T is
cut into 2N chunks and rank r holds chunks r and 2N-1-r, concatenated (`shard_sequence`). With
contiguous shards the last rank would attend to everything and the first to almost nothing;
with zig-zag pairs every rank does the same causal work at every ring step: at step 0 its own
block under the causal mask, and afterwards exactly one half-block product, either all its
queries against the held block's early chunk (the block comes from a lower rank) or its late
chunk of queries against the whole held block (from a higher rank). `positions_for` gives the
global positions of a rank's tokens (for position embeddings), `unshard_sequence` and
`gather_sequence` put the whole sequence back together.

Why raylane's own: torch's `context_parallel` (`torch.distributed.tensor.experimental`) in
2.13 dispatches only the CUDA SDPA kernels and has no CPU handler, so on gloo there is
nothing to call. This kernel uses only `batch_isend_irecv`, so it runs on gloo and NCCL alike.

Communication volume, per rank and call, with a local k (and v) of `b` bytes: the forward
sends N-1 k/v blocks (2 b (N-1); the sends of a step overlap its compute); the backward sends
N-1 k/v blocks again plus N-1 fp32 dk/dv accumulators. That is the volume of an all-gather of
k and v, but in pieces of the local size, so memory stays O(T/N). `ring_traffic` computes it
ahead of time and a `RingTraffic` passed to `ring_attention` counts what was sent.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_ALL = slice(None)  # every row of a local sequence or a held block
# Every rank posts its sends and receives in the same order, which is all NCCL (no tags) needs;
# on gloo the tags also keep a step's k/v and gradient messages apart.
_KV_TAG, _GRAD_TAG = 0, 1


@dataclass
class RingTraffic:
    """Bytes this rank sent round the ring, summed over the calls that were given it."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    transfers: int = 0
    #: Seconds this rank waited for transfers after computing with what it held: the ring's
    #: exposed time (the rest of the transfers overlapped the blocks' compute).
    wait_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def _check_split(length: int, world: int) -> int:
    if world < 1 or length % (2 * world):
        raise ValueError(
            f"context parallelism over {world} ranks cuts a sequence into {2 * world} equal "
            f"chunks, so its length must be a multiple of {2 * world}; got {length}"
        )
    return length // (2 * world)


def shard_sequence(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's part of a whole sequence: chunks `rank` and `2 * world - 1 - rank` of the
    `2 * world` equal chunks along `dim`, concatenated in that order."""
    _check_split(x.shape[dim], world)
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def positions_for(length: int, rank: int, world: int) -> torch.Tensor:
    """Global positions (int64) of the tokens `shard_sequence` gives this rank of a sequence of
    `length` tokens, in the order the rank holds them."""
    chunk = _check_split(length, world)
    late = 2 * world - 1 - rank
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange(late * chunk, (late + 1) * chunk),
        ]
    )


def unshard_sequence(
    parts: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int
) -> torch.Tensor:
    """The whole sequence from every rank's part (in rank order): the inverse of
    `shard_sequence`."""
    world = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for rank, part in enumerate(parts):
        early, late = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * world - 1 - rank] = early, late
    return torch.cat(chunks, dim=dim)


def gather_sequence(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The whole sequence on every rank, from each rank's zig-zag part (an all-gather), e.g.
    to check a loss or an output against an unsharded run. Not differentiable."""
    _, world = _ring_position(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, dim)


def ring_traffic(k: torch.Tensor, world: int) -> RingTraffic:
    """The bytes one `ring_attention` call sends from each rank, for a local key tensor `k`
    (values have its shape and dtype): forward N-1 k/v blocks; backward N-1 k/v blocks and
    N-1 fp32 dk/dv accumulators."""
    steps = world - 1
    kv = 2 * k.numel() * k.element_size()
    grads = 2 * k.numel() * 4
    return RingTraffic(
        forward_bytes=steps * kv, backward_bytes=steps * (kv + grads), transfers=3 * steps
    )


def _ring_position(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _block_plan(rank: int, world: int, step: int, length: int) -> tuple[slice, slice, bool]:
    """(local query rows, held key/value rows, causal) for the block held at `step`, the block
    of rank `(rank - step) % world`. A local sequence of `length` rows is the early chunk
    (`rank`) then the late chunk (`2N-1-rank`); so is the held block, of its own rank."""
    half = length // 2
    if step == 0:
        # Own block: local order is global order, so this is plain causal attention.
        return _ALL, _ALL, True
    if (rank - step) % world < rank:
        # A lower rank's block: both local chunks come after its early chunk and before its
        # late one.
        return _ALL, slice(0, half), False
    # A higher rank's block: only the local late chunk comes after its chunks (both of them).
    return slice(half, None), _ALL, False


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        length = scores.shape[-1]
        above = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _attend(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block in fp32: its output and log-sum-exp per query row."""
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _attend_backward(q, k, v, dout, delta, lse, causal: bool, scale: float):
    """Gradients of one block's contribution, from the whole softmax's saved log-sum-exp and
    `delta` (rowsum of dout * out): the block's probabilities are exactly its share."""
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dscores = probs * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), q) * scale
    return dq, dk, dv


def _exchange(send: torch.Tensor, group, rank: int, world: int, tag: int):
    """Start sending `send` to the next rank and receiving the previous rank's into a new
    buffer; returns (buffer, requests) so the caller computes before waiting."""
    received = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world, tag=tag),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % world, tag=tag),
    ]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests, traffic: RingTraffic | None) -> None:
    started = time.perf_counter()
    for request in requests:
        request.wait()
    if traffic is not None:
        traffic.wait_s += time.perf_counter() - started


def _merge(out, lse, rows: slice, block_out, block_lse) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones, in place, for `rows`."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - new).unsqueeze(-1) + block_out * (
        torch.exp(block_lse - new).unsqueeze(-1)
    )
    lse[..., rows] = new


def _block_grads(k: torch.Tensor, keys: slice, dk, dv) -> torch.Tensor:
    """A held block's dk and dv, stacked in fp32 over all its rows (zeros where unattended)."""
    grads = k.new_zeros((2, *k.shape), dtype=torch.float32)
    grads[0][..., keys, :] = dk
    grads[1][..., keys, :] = dv
    return grads


def _count(traffic: RingTraffic | None, tensor: torch.Tensor, backward: bool) -> None:
    if traffic is None:
        return
    sent = tensor.numel() * tensor.element_size()
    if backward:
        traffic.backward_bytes += sent
    else:
        traffic.forward_bytes += sent
    traffic.transfers += 1


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own backward: send/recv have no autograd."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, traffic):
        rank, world = _ring_position(group)
        queries, kv = q.float(), torch.stack([k, v])
        out = torch.zeros_like(queries)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(world):
            if step + 1 < world:
                incoming, requests = _exchange(kv, group, rank, world, _KV_TAG)
                _count(traffic, kv, backward=False)
            rows, keys, causal = _block_plan(rank, world, step, q.shape[-2])
            block_out, block_lse = _attend(
                queries[..., rows, :],
                kv[0][..., keys, :].float(),
                kv[1][..., keys, :].float(),
                causal,
                scale,
            )
            _merge(out, lse, rows, block_out, block_lse)
            if step + 1 < world:
                _wait(requests, traffic)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.traffic = group, scale, traffic
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, traffic = ctx.group, ctx.scale, ctx.traffic
        rank, world = _ring_position(group)
        queries, dout = q.float(), dout.float()
        delta = (dout * out).sum(dim=-1)
        dq = torch.zeros_like(queries)
        kv, home, pending = torch.stack([k, v]), None, None
        for step in range(world):
            if step + 1 < world:
                incoming, requests = _exchange(kv, group, rank, world, _KV_TAG)
                _count(traffic, kv, backward=True)
            rows, keys, causal = _block_plan(rank, world, step, q.shape[-2])
            block_dq, dk, dv = _attend_backward(
                queries[..., rows, :],
                kv[0][..., keys, :].float(),
                kv[1][..., keys, :].float(),
                dout[..., rows, :],
                delta[..., rows],
                lse[..., rows],
                causal,
                scale,
            )
            dq[..., rows, :] += block_dq
            grads = _block_grads(k, keys, dk, dv)
            if step == 0:
                home = grads  # this rank's own block: its gradients start and end here
            else:
                # The held block's accumulator arrives from the previous rank (from step 2 on:
                # at step 1 this rank is the first after the block's home) and moves on.
                if pending is not None:
                    _wait(pending[2], traffic)
                    grads += pending[1]
                pending = (grads, *_exchange(grads, group, rank, world, _GRAD_TAG))
                _count(traffic, grads, backward=True)
            if step + 1 < world:
                _wait(requests, traffic)
                kv = incoming
        if pending is not None:  # this rank's own accumulator, back from its trip round
            _wait(pending[2], traffic)
            home += pending[1]
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    scale: float | None = None,
    traffic: RingTraffic | None = None,
) -> torch.Tensor:
    """Exact causal softmax attention over a sequence split across the ranks of `group`.

    Args:
        q, k, v: `[batch, heads, local_len, head_dim]`, this rank's tokens in the zig-zag
            order of `shard_sequence` (so `local_len` is even); one dtype and shape.
        group: the context-parallel ring (the default group when None; no communication when
            torch.distributed is not initialised or the group has one rank).
        scale: the scores' factor, `1 / sqrt(head_dim)` when None (as SDPA's default).
        traffic: counts the bytes this rank sends, forward and backward.

    Returns:
        This rank's rows of `scaled_dot_product_attention(q, k, v, is_causal=True)` over the
        whole sequence, in q's dtype. Every rank of the group must call it (and its backward)
        together: both pass blocks round the ring.
    """
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(
            "ring_attention takes q, k and v of one shape [batch, heads, local_len, head_dim]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-2] % 2:
        raise ValueError(
            f"a rank holds two equal chunks of the sequence, so local_len must be even; "
            f"got {q.shape[-2]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # Outside autocast (bf16 training): it would run the forward's score matmuls in bf16 while
    # the backward recomputes them in fp32 against the forward's log-sum-exp.
    with torch.autocast(q.device.type, enabled=False):
        out = _RingAttention.apply(q.float(), k.float(), v.float(), group, scale, traffic)
    return out.to(q.dtype)
