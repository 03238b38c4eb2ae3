"""A small GPT-style decoder over bytes: token + position embedding, N blocks, head.

No parallelism inside. Blocks live in a `ModuleDict` keyed by their index, so a pipeline stage
can be this same model with the other stages' parts deleted: parameter names stay those of the
whole model, and the stages' state dicts merge back into one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from raylane.models.kv_cache import KVCache
from raylane.models.losses import head_cross_entropy, head_token_sums


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate query, key and value projections, so that a
    tensor-parallel plan can split them column-wise (heads across ranks) and `proj` row-wise.
    The forward reads the number of heads from its inputs' width, which is what a rank holds.
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        width = q.shape[-1]  # this rank's heads x head_dim
        shape = (batch, length, width // self.head_dim, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = self.attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of `[batch, heads, length, head_dim]` queries, keys and values over
        the sequence they hold (context parallelism replaces it with ring attention over the
        whole sequence's chunks: `raylane.parallel.parallelize`)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_cached(self, x, cache, layer: int, step) -> torch.Tensor:
        """Attention of new tokens `x` `[n, new, d]` over their slots' cached prefixes plus
        themselves; their keys and values are written to `cache` where `step` says
        (`raylane.models.kv_cache`)."""
        batch, length, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        width = q.shape[-1]
        shape = (batch, length, width // self.head_dim, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        keys, values, visible = cache.append(layer, step, k, v)
        # A boolean mask or none at all (prompts into empty slots are plainly causal): SDPA's
        # fused kernels take these; an additive float mask would cost a [n, 1, new, L] tensor.
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, is_causal=step.causal
        )
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Models saved before the projections were separate hold one fused `qkv`.
        for kind in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
            if fused is not None:
                for name, part in zip("qkv", fused.chunk(3, dim=0), strict=True):
                    state_dict[f"{prefix}{name}.{kind}"] = part
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward_cached(self, x, cache, layer: int, step) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.ln1(x), cache, layer, step)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model: tokens `[B, T]` (int64) -> logits `[B, T, vocab]`.

    When a stage has no embedding (a later pipeline stage), its input is the previous stage's
    hidden states `[B, T, d_model]`; when it has no head, it returns hidden states.
    """

    # The module holding how its blocks split over tensor-parallel workers (named, not
    # imported: its DTensor imports are paid only where tensor parallelism is applied).
    tp_plan = "raylane.models.gpt_plan"

    def __init__(self, vocab_size: int, context_length: int, d_model: int, n_heads: int,
                 n_layers: int):  # fmt: skip
        super().__init__()
        self.tok_emb: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(context_length, d_model)
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_heads) for i in range(n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.head: nn.Linear | None = nn.Linear(d_model, vocab_size)

    #: `forward` takes `targets` and returns the loss (`head_cross_entropy`): the strategies'
    #: steps never hold the whole vocabulary's logits.
    takes_targets = True

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None,
        chunk_bytes: float | None = None, sums: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Logits of tokens `x` `[B, T]` (or hidden states of a later stage); with `targets`
        (a whole model's), the mean cross-entropy, its head computed in chunks of at most
        `chunk_bytes` of logits (`raylane.models.losses.head_cross_entropy`), or with `sums`
        validation's `(loss_sum, correct, counted)` so (`head_token_sums`)."""
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb(self.positions(x.shape[1], x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            if targets is not None:  # validation's sums, or the training loss
                fused = head_token_sums if sums else head_cross_entropy
                return fused(self.norm(x), self.head, targets, chunk_bytes)
            x = self.head(self.norm(x))
        return x

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The positions of the `length` tokens a forward gets: 0..length-1 (a context-parallel
        worker's chunks sit elsewhere in the sequence: `raylane.parallel.parallelize`)."""
        return torch.arange(length, device=device)

    def extend(
        self, tokens: torch.Tensor, cache, slots: list[int], counts: list[int] | None = None
    ) -> torch.Tensor:
        """Append `tokens` `[n, new]` (on the model's device) to the sequences in cache `slots`
        (host ints, one per row) and return their logits `[n, new, vocab]`, computing only the
        new positions (a KV cache).

        A prefill is prompts into empty slots, right-padded to the longest, with `counts` the
        real tokens of each row (the padding is written past a slot's length, where nothing
        reads it); a decode step is every running slot and one token each. The logits equal
        `forward` on each whole sequence (to float rounding).

        Raises:
            ValueError: for a pipeline stage (no embedding or head), or past the context.
        """
        step = cache.plan(slots, tokens.shape[1])
        logits = self.forward_step(tokens, cache, step)
        cache.advance(slots, counts or [tokens.shape[1]] * len(slots))
        return logits

    @property
    def max_positions(self) -> int:
        """The positions the model reads (its position table's length)."""
        return self.pos_emb.num_embeddings

    def kv_cache(self, slots: int, max_len: int | None = None) -> KVCache:
        """A cache of `slots` sequences of up to `max_len` positions (default: the context) on
        the model's device and in its dtype."""
        return KVCache.for_model(self, slots, max_len)

    def forward_step(self, tokens: torch.Tensor, cache, step) -> torch.Tensor:
        """Logits of `tokens` `[n, new]` placed in `cache` where `step` says (a `CacheStep`),
        their keys and values written there; the cache's lengths are the caller's to advance.
        Nothing is read back to the host, so a fixed-shape step can be captured in a CUDA
        graph (`raylane.serving.generation.static_decode`).

        Raises:
            ValueError: for a pipeline stage (no embedding or head).
        """
        if self.tok_emb is None or self.head is None:
            raise ValueError("extend needs the whole model (embedding to head), not one stage")
        x = self.tok_emb(tokens) + self.pos_emb(step.positions)
        for layer, block in enumerate(self.blocks.values()):
            x = block.forward_cached(x, cache, layer, step)
        return self.head(self.norm(x))
