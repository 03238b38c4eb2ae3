"""What the engine reads of a model it serves, through the decoding interface every language
family's module has (`raylane.models.gpt.GPT`, `raylane.models.llama.LlamaForCausalLM`):
`max_positions`, `tok_emb`, `kv_cache(slots, max_len)`, `extend` and `forward_step`. The
engine never asks which family it holds."""

from __future__ import annotations

import torch

from raylane.models.kv_cache import KVCache


def context_length(model: torch.nn.Module) -> int:
    """The positions the model reads."""
    return model.max_positions


def vocabulary(model: torch.nn.Module) -> int:
    """The number of token ids the model embeds."""
    return model.tok_emb.num_embeddings


def new_cache(model: torch.nn.Module, slots: int, max_len: int | None = None) -> KVCache:
    """A KV cache of `slots` sequences of up to `max_len` positions (default: the context) on
    the model's device and in its dtype (a grouped-query model's holds its key/value heads
    only)."""
    return model.kv_cache(slots, max_len)
