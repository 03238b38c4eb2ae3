"""Keys and values already computed for the sequences a GPT is generating, one slot each.

A cache holds `slots` sequences of up to `max_len` positions for every block, on the model's
device and in its dtype. Each slot has its own length, so sequences of different lengths decode
together in one forward (continuous batching): a step appends one position to every running
slot, a prefill appends whole prompts to empty slots. Positions past a slot's length are never
read (they are masked out), so freeing a slot or dropping rejected draft tokens is only a change
of its length.

The lengths are the scheduler's bookkeeping and stay on the host (Python ints): planning a
forward never reads a value back from the device. What a forward needs from them (positions,
the attention mask) is built on the device, from host values copied without waiting for the
work already queued there (`ints_on`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def ints_on(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`. On CUDA the copy leaves pinned host memory
    without blocking: a plain host-to-device copy waits for the stream, which in the middle of
    a step is a host sync."""
    if device.type == "cuda":
        host = torch.tensor(values, dtype=torch.long, device="cpu", pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.long, device=device)


def placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and compute dtype of a whole GPT, read from its final norm: a layer that int8
    quantization and LoRA wrapping leave a plain parameter."""
    weight = model.norm.weight
    return weight.device, weight.dtype


def cache_attention_kernels(device: torch.device):
    """The SDPA backends for attention over the cache: on CUDA flash, memory-efficient and
    math, not cuDNN's, which builds an execution plan for every new shape (a decode step's
    prefix grows each step: such builds dominated cold bf16 decoding); elsewhere unchanged."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(backends)


@dataclass(frozen=True)
class CacheStep:
    """One forward's place in the cache (`KVCache.plan`), shared by every block."""

    slots: torch.Tensor  # [n] on the cache's device
    positions: torch.Tensor  # [n, new] on the cache's device
    length: int  # the longest prefix attention reads, new tokens included
    mask: torch.Tensor | None  # [n, 1, new, length] (True: visible), None: nothing to hide
    causal: bool  # every slot was empty: the new tokens see themselves causally, nothing else
    slot: int | None  # the one slot, when there is one
    start: int  # its first new position
    whole: bool = False  # every slot in order, attention over the whole buffer (fixed shapes)


class KVCache:
    """Per-block key and value tensors `[slots, heads, max_len, head_dim]` and slot lengths."""

    def __init__(
        self,
        n_layers: int,
        slots: int,
        n_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (slots, n_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = [0] * slots
        self.max_len = max_len
        self.device = torch.device(device)

    @classmethod
    def for_model(cls, model: torch.nn.Module, slots: int, max_len: int | None = None) -> KVCache:
        """A cache shaped for `model` (a whole `raylane.models.gpt.GPT`), on its device and in
        its dtype."""
        first = next(iter(model.blocks.values())).attn
        device, dtype = placement(model)
        return cls(
            n_layers=len(model.blocks),
            slots=slots,
            n_heads=first.q.out_features // first.head_dim,
            max_len=max_len or model.pos_emb.num_embeddings,
            head_dim=first.head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def reset(self, slot: int) -> None:
        """Free `slot`: its old entries are masked out and overwritten by the next sequence."""
        self.lengths[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of `slot` (drop rejected draft tokens)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} positions, not {length}")
        self.lengths[slot] = length

    def plan(self, slots: list[int], new: int) -> CacheStep:
        """What one forward appending `new` tokens to each of `slots` writes and reads, worked
        out once for all blocks: positions, the longest prefix L after it, and how attention
        sees it. Empty slots (prompts) attend causally among their new tokens alone (SDPA's
        `is_causal`, no mask: its fast kernels); one token of one slot sees its whole prefix
        (no mask); otherwise a boolean mask lets each token see its own prefix only.

        Raises:
            ValueError: when a slot would pass `max_len` (the model's context).
        """
        starts = [self.lengths[s] for s in slots]
        length = max(starts) + new
        if length > self.max_len:
            raise ValueError(
                f"a sequence would reach {length} positions; the context holds {self.max_len}"
            )
        device, offsets = self.device, torch.arange(new, device=self.device)
        index = ints_on(slots, device)
        causal = not any(starts)
        if len(slots) == 1:
            start = starts[0]
            mask = None
            if new > 1 and start:  # a draft catching up: the prefix and the new tokens
                mask = torch.ones(new, length, dtype=torch.bool, device=device).tril(start)
                mask = mask[None, None]
            return CacheStep(index, (offsets + start)[None], length, mask, causal and new > 1,
                             slots[0], start)  # fmt: skip
        if causal:
            return CacheStep(index, offsets.expand(len(slots), new), new, None, True, None, 0)
        positions = ints_on(starts, device)[:, None] + offsets[None, :]
        visible = torch.arange(length, device=device)[None, None, :] <= positions[:, :, None]
        return CacheStep(index, positions, length, visible[:, None], False, None, 0)

    def every_slot_step(self, lengths: torch.Tensor) -> CacheStep:
        """One token appended to every slot at its length (`lengths` `[slots]` on the device),
        attention over the whole `max_len` buffer under a mask: the same shapes every step and
        no host value, so the step can be captured in a CUDA graph. Free slots compute too
        (their garbage lands past their length, where nothing reads it)."""
        rows = torch.arange(self.slots, device=self.device)
        keys_at = torch.arange(self.max_len, device=self.device)
        visible = keys_at[None, :] <= lengths[:, None]  # a slot's prefix and the new token
        positions = lengths.clamp(max=self.max_len - 1)[:, None]  # never past the buffer
        return CacheStep(rows, positions, self.max_len, visible[:, None, None, :], False, None,
                         0, whole=True)  # fmt: skip

    def append(
        self, layer: int, step: CacheStep, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the new keys and values `[n, heads, new, head_dim]` of block `layer` where
        `step` (`plan`) puts them, and return what attention reads: keys and values
        `[n, heads, L, head_dim]` of each slot's first L positions and the step's mask
        `[n, 1, new, L]` letting each new token see its own prefix only (or None). Empty slots
        read the new keys and values themselves (no gather from the cache)."""
        keys, values = self.keys[layer], self.values[layer]
        if step.slot is not None:  # one slot: plain slices, views instead of gathered copies
            keys[step.slot, :, step.start : step.length] = k[0]
            values[step.slot, :, step.start : step.length] = v[0]
            window = slice(step.slot, step.slot + 1)
            return keys[window, :, : step.length], values[window, :, : step.length], step.mask
        if step.causal:  # prompts into empty slots, right-padded to the longest
            keys[step.slots, :, : step.length] = k
            values[step.slots, :, : step.length] = v
            return k, v, None
        index = (step.slots[:, None], slice(None), step.positions)
        keys[index] = k.transpose(1, 2)  # advanced indices first: [n, new, heads, head_dim]
        values[index] = v.transpose(1, 2)
        if step.whole:
            return keys, values, step.mask
        return keys[step.slots, :, : step.length], values[step.slots, :, : step.length], step.mask

    def advance(self, slots: list[int], counts: list[int]) -> None:
        """Count `counts` positions as written to each of `slots` (after every block wrote
        them; a right-padded prompt counts its own tokens, not the padding)."""
        for slot, count in zip(slots, counts, strict=True):
            self.lengths[slot] += count
