"""Keys and values already computed for the sequences a GPT is generating, one slot each.

A cache holds `slots` sequences of up to `max_len` positions for every block. Each slot has its
own length, so sequences of different lengths decode together in one forward (continuous
batching): a step appends one position to every running slot, a prefill appends a whole prompt
to one. Positions past a slot's length are never read (they are masked out), so freeing a slot
or dropping rejected draft tokens is only a change of its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheStep:
    """One forward's place in the cache (`KVCache.plan`), shared by every block."""

    slots: torch.Tensor
    positions: torch.Tensor  # [n, new]
    length: int  # the longest prefix attention reads, new tokens included
    mask: torch.Tensor | None  # [n, 1, new, length], None: nothing to hide
    slot: int | None  # the one slot, when there is one
    start: int  # its first new position


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

    def plan(self, slots: torch.Tensor, new: int) -> CacheStep:
        """What one forward appending `new` tokens to each of `slots` writes and reads, worked
        out once for all blocks: positions, the longest prefix L after it, and the attention
        mask (None where every new token may see every position up to L: one token of one
        slot, the decode step of a single stream).

        Raises:
            ValueError: when a slot would pass `max_len` (see `positions`).
        """
        positions = self.positions(slots, new)
        length = int(positions.max()) + 1
        if len(slots) == 1:
            slot, start = int(slots[0]), length - new
            mask = None
            if new > 1:  # a prompt: each token sees the prefix and the prompt up to itself
                mask = torch.ones(new, length, dtype=torch.bool).tril(start)[None, None]
            return CacheStep(slots, positions, length, mask, slot, start)
        visible = torch.arange(length)[None, None, :] <= positions[:, :, None]
        return CacheStep(slots, positions, length, visible[:, None], None, 0)

    def append(
        self, layer: int, step: CacheStep, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the new keys and values `[n, heads, new, head_dim]` of block `layer` where
        `step` (`plan`) puts them, and return what attention reads: keys and values
        `[n, heads, L, head_dim]` of each slot's first L positions and the step's mask
        `[n, 1, new, L]` letting each new token see its own prefix only (or None)."""
        keys, values = self.keys[layer], self.values[layer]
        if step.slot is not None:  # one slot: plain slices, views instead of gathered copies
            keys[step.slot, :, step.start : step.length] = k[0]
            values[step.slot, :, step.start : step.length] = v[0]
            window = slice(step.slot, step.slot + 1)
            return keys[window, :, : step.length], values[window, :, : step.length], step.mask
        index = (step.slots[:, None], slice(None), step.positions)
        keys[index] = k.transpose(1, 2)  # advanced indices first: [n, new, heads, head_dim]
        values[index] = v.transpose(1, 2)
        return keys[step.slots, :, : step.length], values[step.slots, :, : step.length], step.mask

    def advance(self, slots: torch.Tensor, new: int) -> None:
        """Count `new` positions as written to each of `slots` (after every block wrote them)."""
        self.lengths[slots] += new
