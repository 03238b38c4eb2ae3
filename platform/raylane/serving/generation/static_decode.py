"""A decode step with fixed shapes: one token for every cache slot, attention over the whole
buffer under a mask, inputs in device buffers that stay at the same address.

The dynamic step (`ModelRunner.decode`) sizes its tensors to the running batch and its longest
prefix, so its shapes change every step and its plan is worked out on the host. This step
always computes all `max_num_seqs` slots over all `max_len` positions: more arithmetic (free
slots and masked positions), but nothing to plan and nothing read back, so the whole forward
can be captured once in a CUDA graph and replayed (`raylane.serving.generation.cuda_graph`): a token
then costs the GPU's time, not Python's. On the CPU it runs eagerly and decodes the same greedy
tokens as the dynamic step (masked positions add exact zeros).
"""

from __future__ import annotations

import torch

from raylane.models.kv_cache import KVCache, cache_attention_kernels, ints_on


class StaticDecode:
    """`model`'s fixed-shape decode step over `cache` (every slot, one token)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache):
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(cache.slots, 1, dtype=torch.long, device=cache.device)
        self.lengths = torch.zeros(cache.slots, dtype=torch.long, device=cache.device)

    def load(self, tokens: list[int], lengths: list[int]) -> None:
        """Each slot's last token and length (host values) into the step's device buffers,
        copied without waiting for queued work."""
        self.tokens.copy_(ints_on(tokens, self.cache.device)[:, None], non_blocking=True)
        self.lengths.copy_(ints_on(lengths, self.cache.device), non_blocking=True)

    def forward(self) -> torch.Tensor:
        """Logits `[slots, vocab]` of the loaded tokens; their keys and values are written at
        each slot's length (the host advances the lengths of the slots it uses)."""
        step = self.cache.every_slot_step(self.lengths)
        with cache_attention_kernels(self.cache.device):  # a mask: no flash, no cuDNN plans
            return self.model.forward_step(self.tokens, self.cache, step)[:, -1]

    def __call__(self, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        self.load(tokens, lengths)
        return self.forward()
