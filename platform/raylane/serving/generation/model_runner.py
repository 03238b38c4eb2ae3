"""The engine's model side: the target model, its KV cache and its adapters on one device.

The scheduler (`raylane.serving.generation.engine`) decides which sequences run; the runner turns
them into tensors on the model's device (from host lists, copied without waiting: `ints_on`), runs
the forward and chooses the next tokens there. Nothing is read back here: each forward returns a
`Launch`, and the step reads the tokens of all its launches back in one host sync (`read_back`), as
vLLM's model runner hands sampled ids back once per step.

Prompts admitted together are prefilled in one forward, right-padded to the longest: empty
slots attend causally among their own tokens (SDPA's `is_causal`, no mask), so a padded row's
real tokens compute what they would alone. Decode steps read every running slot's prefix under
a boolean mask. On CUDA these forwards run without the cuDNN attention backend, which builds an
execution plan for every new shape (a decode step's prefix grows by one token each step).

Decode steps take one of three paths (`decode`): 'dynamic' (shapes follow the running batch),
'static' (every slot over the whole buffer, fixed shapes:
`raylane.serving.generation.static_decode`) or 'cuda_graph' (that step captured once and replayed:
`raylane.serving.generation.cuda_graph`). Steps with a sequence through a LoRA adapter always run
the dynamic path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from raylane.models.kv_cache import cache_attention_kernels, ints_on, placement
from raylane.models.multi_lora import AdapterSet
from raylane.serving.generation.cuda_graph import GraphedDecode
from raylane.serving.generation.model_shape import new_cache
from raylane.serving.generation.next_token import choose_tokens
from raylane.serving.generation.sequence import Sequence
from raylane.serving.generation.static_decode import StaticDecode

Decode = Literal["dynamic", "static", "cuda_graph"]


@dataclass(frozen=True)
class Launch:
    """Work queued on the device for some sequences: `tokens` to read back (int64, `[n]` or
    `[n, m]`), and `apply`, which takes them as host lists and updates the sequences."""

    sequences: list[Sequence]
    tokens: torch.Tensor
    apply: Callable[[list], None]


def read_back(tensors: list[torch.Tensor]) -> list[list]:
    """The values of every tensor as host lists, read in one device-to-host copy (the step's
    one host sync): `[n]` gives n ints, `[n, m]` n lists of m."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors]).tolist()
    values, offset = [], 0
    for tensor in tensors:
        part = flat[offset : offset + tensor.numel()]
        offset += tensor.numel()
        if tensor.dim() == 2:
            width = tensor.shape[1]
            part = [part[i : i + width] for i in range(0, len(part), width)]
        values.append(part)
    return values


def append_each(sequences: list[Sequence], tokens: list[int]) -> None:
    """`apply` of a launch that chose one token per sequence."""
    for sequence, token in zip(sequences, tokens, strict=True):
        sequence.append(token)


class ModelRunner:
    """A whole GPT or Llama in eval mode with `max_num_seqs` cache slots of `max_len`
    positions (default: the model's context) and, with `max_adapters > 0`,
    a LoRA `AdapterSet` (each sequence through its own adapter, all in one forward).

    Raises:
        ValueError: an unknown `decode`, or 'cuda_graph' for a model not on a CUDA device.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        max_adapters: int = 0,
        decode: Decode = "dynamic",
        max_len: int | None = None,
    ):
        self.model = model.eval()
        self.device, _ = placement(model)
        self.cache = new_cache(model, max_num_seqs, max_len)
        self.adapters = AdapterSet(self.model, max_adapters) if max_adapters else None
        self.forwards = 0  # batched forwards run (prefills, decode and verify steps)
        # The fixed-shape step: (each slot's last token, each slot's length) -> logits.
        self.static: Callable[[list[int], list[int]], torch.Tensor] | None = None
        if decode == "static":
            self.static = StaticDecode(self.model, self.cache)
        elif decode == "cuda_graph":
            self.static = GraphedDecode(self.model, self.cache)
        elif decode != "dynamic":
            raise ValueError(f"decode is 'dynamic', 'static' or 'cuda_graph', not {decode!r}")

    def extend(self, sequences: list[Sequence], tokens: torch.Tensor, counts=None):
        """Logits of `tokens` `[n, new]` appended to the sequences' slots, each row through
        its sequence's adapter."""
        if self.adapters is not None:
            self.adapters.select([s.adapter for s in sequences])
        with cache_attention_kernels(self.device):
            logits = self.model.extend(tokens, self.cache, [s.slot for s in sequences], counts)
        self.forwards += 1
        return logits

    def prefill(self, sequences: list[Sequence]) -> Launch:
        """Read the prompts of freshly admitted sequences (empty slots) in one forward and
        choose each one's first token."""
        counts = [len(s.prompt) for s in sequences]
        width = max(counts)
        rows = [s.prompt + [0] * (width - len(s.prompt)) for s in sequences]
        logits = self.extend(sequences, ints_on(rows, self.device), counts)
        last = ints_on([count - 1 for count in counts], self.device)
        logits = logits[torch.arange(len(sequences), device=self.device), last]
        return Launch(sequences, self._choose(sequences, logits), self._appender(sequences))

    def decode(self, sequences: list[Sequence]) -> Launch:
        """One token for every sequence, in one forward over their slots."""
        if self.static is not None and not any(s.adapter for s in sequences):
            logits = self._decode_every_slot(sequences)
        else:
            last = ints_on([[s.output[-1]] for s in sequences], self.device)
            logits = self.extend(sequences, last)[:, -1]
        return Launch(sequences, self._choose(sequences, logits), self._appender(sequences))

    def _decode_every_slot(self, sequences: list[Sequence]) -> torch.Tensor:
        """The fixed-shape step over every slot; the logits of `sequences`' slots."""
        slots = [s.slot for s in sequences]
        tokens = [0] * self.cache.slots
        for sequence in sequences:
            tokens[sequence.slot] = sequence.output[-1]
        if self.adapters is not None:
            self.adapters.select([0] * len(sequences))
        logits = self.static(tokens, self.cache.lengths)[ints_on(slots, self.device)]
        self.cache.advance(slots, [1] * len(slots))
        self.forwards += 1
        return logits

    @staticmethod
    def _choose(sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        params = [s.params for s in sequences]
        return choose_tokens(logits, params, [s.generator for s in sequences])

    @staticmethod
    def _appender(sequences: list[Sequence]) -> Callable[[list], None]:
        return lambda tokens: append_each(sequences, tokens)
