"""What the engine reads of a model's shape, for both families it serves: the byte-level
`raylane.models.gpt.GPT` and a `raylane.models.llama.LlamaForCausalLM` (its context, its
vocabulary, a KV cache shaped for it)."""

from __future__ import annotations

import torch

from raylane.models.kv_cache import KVCache
from raylane.models.llama import LlamaForCausalLM


def context_length(model: torch.nn.Module) -> int:
    """The positions the model reads: a GPT's position table, a Llama's max_positions."""
    if isinstance(model, LlamaForCausalLM):
        return model.config.max_positions
    return model.pos_emb.num_embeddings


def vocabulary(model: torch.nn.Module) -> int:
    """The number of token ids the model embeds."""
    return model.tok_emb.num_embeddings


def new_cache(model: torch.nn.Module, slots: int, max_len: int | None = None) -> KVCache:
    """A KV cache of `slots` sequences of up to `max_len` positions (default: the context) on
    the model's device and in its dtype (a Llama's holds its key/value heads only)."""
    if isinstance(model, LlamaForCausalLM):
        return model.kv_cache(slots, max_len)
    return KVCache.for_model(model, slots, max_len)
