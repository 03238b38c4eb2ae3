"""Keys and values already computed for the sequences a GPT is generating, one slot each.

A cache holds `slots` sequences of up to `max_len` positions for every block. Each slot has its
own length, so sequences of different lengths decode together in one forward (continuous
batching): a step appends one position to every running slot, a prefill appends a whole prompt
to one. Positions past a slot's length are never read (they are masked out), so freeing a slot
or dropping rejected draft tokens is only a change of its length.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-block key and value tensors `[slots, heads, max_len, head_dim]` and slot lengths."""

    def __init__(
        self,
        n_layers: int,
        slots: int,
        n_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ):
        shape = (slots, n_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: torch.nn.Module, slots: int, max_len: int | None = None) -> KVCache:
        """A cache shaped for `model` (a whole `raylane.models.gpt.GPT`)."""
        first = next(iter(model.blocks.values())).attn
        return cls(
            n_layers=len(model.blocks),
            slots=slots,
            n_heads=first.q.out_features // first.head_dim,
            max_len=max_len or model.pos_emb.num_embeddings,
            head_dim=first.head_dim,
            dtype=first.q.weight.dtype,
        )

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def reset(self, slot: int) -> None:
        """Free `slot`: its old entries are masked out and overwritten by the next sequence."""
        self.lengths[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (drop rejected draft tokens)."""
        if not 0 <= length <= int(self.lengths[slot]):
            raise ValueError(f"slot {slot} holds {int(self.lengths[slot])} positions, not {length}")
        self.lengths[slot] = length

    def positions(self, slots: torch.Tensor, new: int) -> torch.Tensor:
        """Positions `[n, new]` that `new` tokens appended to each of `slots` take.

        Raises:
            ValueError: when a slot would pass `max_len` (the model's context).
        """
        start = self.lengths[slots]
        end = int(start.max()) + new if len(start) else new
        if end > self.max_len:
            raise ValueError(
                f"a sequence would reach {end} positions; the context holds {self.max_len}"
            )
        return start[:, None] + torch.arange(new)[None, :]

    def append(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Write the new keys and values `[n, heads, new, head_dim]` of block `layer` at
        `positions`, and return what attention reads: keys and values `[n, heads, L, head_dim]`
        of each slot's first L positions (L: the longest after appending) and a boolean mask
        `[n, 1, new, L]` letting each new token see its own prefix only."""
        keys, values = self.keys[layer], self.values[layer]
        index = (slots[:, None], slice(None), positions)
        keys[index] = k.transpose(1, 2)  # advanced indices first: [n, new, heads, head_dim]
        values[index] = v.transpose(1, 2)
        length = int(positions.max()) + 1
        visible = torch.arange(length)[None, None, :] <= positions[:, :, None]
        return keys[slots, :, :length], values[slots, :, :length], visible[:, None]

    def advance(self, slots: torch.Tensor, new: int) -> None:
        """Count `new` positions as written to each of `slots` (after every block wrote them)."""
        self.lengths[slots] += new
