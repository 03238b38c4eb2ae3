"""Continuous (iteration-level) batching of generations over one model and one KV cache.

Each `step()` is one scheduling iteration, as in Orca and vLLM: requests waiting for a cache
slot are admitted while slots are free, then every running sequence decodes one token in a
single batched forward and the admitted prompts are prefilled together in another. A sequence
leaves as soon as it finishes (its slot is free from the next step on), so short and long
generations share the batch without the short ones waiting for the long ones. `abort` frees a
slot at once (a client that went away).

The engine is the scheduler; `raylane.serving.generation.model_runner` runs the model on its device
and `raylane.serving.generation.speculative` proposes and checks tokens. A step reads its tokens
back from the device once, for all its forwards together (not once per sequence and token): on a GPU
the host would otherwise wait for every forward in turn.

Prompts and outputs are token ids; the engine's `codec` (`raylane.serving.generation.text_codec`)
says what they are: bytes for the byte-level GPT (the text a sequence releases is bytes), a
tokenizer's ids for a Llama-family model (its text is decoded incrementally, and its end-of-sequence
ids end a generation). Text is held back while it might still be the start of a stop sequence.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque

import torch

from raylane.models.kv_cache import ints_on, placement
from raylane.serving.generation.model_runner import Decode, Launch, ModelRunner, read_back
from raylane.serving.generation.model_shape import context_length
from raylane.serving.generation.next_token import SamplingFields, request_generator, sample
from raylane.serving.generation.sequence import Event, Sequence
from raylane.serving.generation.speculative import (
    DraftProposer,
    Speculator,
    check_draft,
    propose_ngram,
)
from raylane.serving.generation.text_codec import BYTES, TextCodec

#: The longest context a sequence may use by default, and so the KV cache's length per slot: a
#: checkpoint's whole context (128k positions for Llama 3.1) would take gigabytes per slot.
#: `serving.generation.max_model_len` sets it for a deployment.
MAX_MODEL_LEN = 8192


__all__ = [
    "Event",
    "GenerationEngine",
    "Sequence",
    "generate_without_cache",
    "propose_ngram",
]


class GenerationEngine:
    """A whole `raylane.models.gpt.GPT` or `raylane.models.llama.LlamaForCausalLM` in eval
    mode with `max_num_seqs` cache slots, on the model's device and in its dtype (place the model
    first: `raylane.serving.generation.placement`). `codec` turns its ids into text (`BYTES` for the
    GPT, a `TokenizerCodec` for a Llama); `max_model_len` caps the context a sequence may use, and
    so the cache (the model's context when shorter).

    With `speculate=k`, each decode step is speculative (`raylane.serving.generation.speculative`):
    proposals from a `draft` model when one is given (on the model's device), else from prompt
    lookup. Greedy output is the plain output; sampled output keeps its distribution. A
    `draft_codec` (the draft's own, as its registered version was loaded) is checked to give
    the same text the same ids as `codec` (`raylane.serving.generation.speculative.codec_mismatch`).

    With `max_adapters > 0`, `adapters` holds that many LoRA adapters of the model
    (`raylane.models.multi_lora`) and each sequence decodes through its own (`add(adapter=)`),
    sequences of different adapters in the same batched forward. The draft proposes without
    adapters; the adapted model checks its proposals, so output is still the adapted model's.

    `decode` picks the plain decode step's path (`raylane.serving.generation.model_runner`):
    'dynamic', 'static' (fixed shapes) or 'cuda_graph' (fixed shapes replayed from a CUDA graph);
    the last two serve plain decoding only (speculate 0).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        speculate: int = 0,
        draft: torch.nn.Module | None = None,
        max_adapters: int = 0,
        decode: Decode = "dynamic",
        *,
        codec: TextCodec = BYTES,
        max_model_len: int = MAX_MODEL_LEN,
        draft_codec: TextCodec | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, not {max_num_seqs}")
        if speculate < 0:
            raise ValueError(f"speculate must be 0 (off) or more, not {speculate}")
        if speculate and decode != "dynamic":
            raise ValueError(f"decode '{decode}' serves plain decoding: speculate must be 0")
        self.context = min(context_length(model), max_model_len)
        self.codec = codec
        self.runner = ModelRunner(model, max_num_seqs, max_adapters, decode, self.context)
        self.model, self.cache, self.adapters = model, self.runner.cache, self.runner.adapters
        self.device = self.runner.device
        self.speculate = speculate
        self.proposer = None
        if draft is not None:
            codecs = None if draft_codec is None else (codec, draft_codec)
            check_draft(model, draft, speculate, self.context, codecs)
            self.proposer = DraftProposer(draft, max_num_seqs, self.context)
        self.speculator = Speculator(self.runner, speculate, self.proposer) if speculate else None
        self.free = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.tokens_generated = 0
        self.finished: Counter[str] = Counter()  # sequences ended, by finish reason

    @property
    def forwards(self) -> int:
        """Batched forwards of the model run (prefills, decode and verify steps)."""
        return self.runner.forwards

    @property
    def draft_forwards(self) -> int:
        """The draft's forwards (prompts, then about k per speculative step)."""
        return self.proposer.forwards if self.proposer is not None else 0

    @property
    def proposed(self) -> int:
        return self.speculator.proposed if self.speculator is not None else 0

    @property
    def accepted(self) -> int:
        return self.speculator.accepted if self.speculator is not None else 0

    def add(self, prompt: list[int], params: SamplingFields, adapter: int = 0) -> Sequence:
        """Queue a request; it starts at the next step that has a free slot. `adapter`: the
        row the caller acquired from `adapters` for it (0: the model alone), released when the
        sequence ends.

        Raises:
            ValueError: see `check`, or an adapter row without an adapter set.
        """
        self.check(prompt, params)
        if adapter and self.adapters is None:
            raise ValueError("this engine holds no adapters (max_adapters is 0)")
        generator = request_generator(params, self.device)
        sequence = Sequence(next(self._ids), list(prompt), params, generator, self.codec)
        sequence.adapter = adapter
        self.waiting.append(sequence)
        return sequence

    def check(self, prompt: list[int], params: SamplingFields) -> None:
        """Raise ValueError naming why this request cannot run: an empty prompt, a token out of
        the codec's range, or a prompt plus `max_tokens` (tokens) longer than the context."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.codec.vocab_size for t in prompt):
            raise ValueError(self.codec.id_range_error())
        if len(prompt) + params.max_tokens > self.context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.context} tokens"
            )

    def abort(self, sequence: Sequence) -> None:
        """Stop `sequence` now, freeing its slot (or its place in the queue)."""
        if sequence.finished:
            return
        if sequence.slot is not None:
            self._free(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
            self._release_adapter(sequence)
        sequence.finish_reason = "abort"
        self.finished["abort"] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Speculative tokens accepted over those checked (None before any was proposed)."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @torch.no_grad()
    def step(self) -> list[Event]:
        """Decode every running sequence and prefill the requests admitted into free slots,
        then read all chosen tokens back at once and hand out what each sequence released."""
        decoding = list(self.running.values())
        admitted = self._admit()
        launches: list[Launch] = []
        if decoding and self.speculator is not None:
            launches.append(self.speculator.launch(decoding))
        elif decoding:
            launches.append(self.runner.decode(decoding))
        if admitted:
            launches.append(self.runner.prefill(admitted))
            if self.proposer is not None:  # the draft reads the prompts too
                self.proposer.prefill(admitted)
        events = []
        for launch, tokens in zip(launches, read_back([x.tokens for x in launches]), strict=True):
            before = [len(s.output) for s in launch.sequences]
            launch.apply(tokens)
            for sequence, length in zip(launch.sequences, before, strict=True):
                self.tokens_generated += len(sequence.output) - length
                if sequence.finished:
                    self.finished[sequence.finish_reason] += 1
                    self._free(sequence)
                events.append(Event(sequence, sequence.release(), sequence.finished))
        return events

    def _admit(self) -> list[Sequence]:
        """Waiting requests moved into free slots (empty: their prompts are read next)."""
        admitted = []
        while self.waiting and self.free:
            sequence = self.waiting.popleft()
            sequence.slot = self.free.pop()
            self.cache.reset(sequence.slot)
            self.running[sequence.id] = sequence
            admitted.append(sequence)
        return admitted

    def _free(self, sequence: Sequence) -> None:
        self.running.pop(sequence.id, None)
        self.cache.reset(sequence.slot)
        if self.proposer is not None:
            self.proposer.reset(sequence.slot)
        self.free.append(sequence.slot)
        sequence.slot = None
        self._release_adapter(sequence)

    def _release_adapter(self, sequence: Sequence) -> None:
        if self.adapters is not None:
            self.adapters.release(sequence.adapter)
            sequence.adapter = 0

    def generate(self, prompt: list[int], params: SamplingFields, adapter: int = 0) -> Sequence:
        """Run one request to its end (a convenience around `add` and `step`)."""
        sequence = self.add(prompt, params, adapter)
        while not sequence.finished:
            self.step()
        return sequence


@torch.no_grad()
def generate_without_cache(
    model: torch.nn.Module, prompt: list[int], params: SamplingFields, codec: TextCodec = BYTES
):
    """The reference: every token from a forward over the whole sequence so far (no cache),
    on the model's device."""
    context = context_length(model)
    if len(prompt) + params.max_tokens > context:
        raise ValueError(f"prompt + max_tokens exceeds the model's context of {context}")
    model.eval()
    device, _ = placement(model)
    generator = request_generator(params, device)
    reference = Sequence(-1, list(prompt), params, generator, codec)
    while not reference.finished:
        logits = model(ints_on([reference.prompt + reference.output], device))[0, -1]
        reference.append(sample(logits, params, generator))
    return reference
