"""Continuous (iteration-level) batching of generations over one model and one KV cache.

Each `step()` is one scheduling iteration, as in Orca and vLLM: requests waiting for a cache
slot are admitted while slots are free (their prompt is prefilled), then every running sequence
decodes one token in a single batched forward. A sequence leaves as soon as it finishes (its
slot is free for the next request at the next step), so short and long generations share the
batch without the short ones waiting for the long ones. `abort` frees a slot at once (a client
that went away).

Tokens are bytes (the GPT's vocabulary is 256): the text a sequence releases is bytes, held
back only while they might still be the start of a stop sequence.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from raylane.generation.sampling import SamplingParams, probabilities, sample, verify
from raylane.models.kv_cache import KVCache
from raylane.models.multi_lora import AdapterSet


@dataclass(eq=False)
class Sequence:
    """One request's prompt, output so far and place in the cache."""

    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stopped_by: bytes = b""  # the stop sequence the output ends with
    released: int = 0  # output bytes handed out so far
    adapter: int = 0  # row of its LoRA adapter in the engine's `AdapterSet` (0: none)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> bytes:
        """The output without a stop sequence that ended it."""
        data = bytes(self.output)
        return data[: len(data) - len(self.stopped_by)]

    def release(self) -> bytes:
        """Output bytes not handed out before and no longer possibly part of a stop sequence."""
        data = self.text()
        if not self.finished:
            hold = max((_held_back(data, s.encode()) for s in self.params.stop), default=0)
            data = data[: len(data) - hold]
        new = data[self.released :]
        self.released = len(data)
        return new


def _held_back(data: bytes, stop: bytes) -> int:
    """Length of the longest end of `data` that a stop sequence starts with."""
    for size in range(min(len(stop) - 1, len(data)), 0, -1):
        if data.endswith(stop[:size]):
            return size
    return 0


def _finish_if_done(sequence: Sequence) -> None:
    """Mark `sequence` finished when its output ends with a stop sequence or is long enough."""
    params = sequence.params
    for stop in (s.encode() for s in params.stop):
        if bytes(sequence.output[-len(stop) :]) == stop:
            sequence.finish_reason, sequence.stopped_by = "stop", stop
            return
    if len(sequence.output) >= params.max_tokens:
        sequence.finish_reason = "length"


@dataclass(frozen=True)
class Event:
    """What one step did for one sequence: its new releasable bytes, and whether it ended."""

    sequence: Sequence
    text: bytes
    finished: bool


class GenerationEngine:
    """A whole `raylane.models.gpt.GPT` in eval mode with `max_num_seqs` cache slots.

    With `speculate=k`, each decode step is speculative: every running sequence proposes k
    tokens, the model checks them all in one forward, and the longest accepted run plus one
    token of the model's own is kept (`verify`): greedy output is the plain output, sampled
    output keeps its distribution. The proposals come from a `draft` model when one is given
    (a smaller GPT over the same bytes, with its own cache slots: k batched draft forwards per
    step, each token drawn from the draft's distribution under the request's sampling), else
    from prompt lookup (the k tokens that followed the last occurrence of the sequence's latest
    n-gram in its own prompt and output).

    With `max_adapters > 0`, `adapters` holds that many LoRA adapters of the model
    (`raylane.models.multi_lora`) and each sequence decodes through its own (`add(adapter=)`),
    sequences of different adapters in the same batched forward. The draft proposes without
    adapters; the adapted model checks its proposals, so output is still the adapted model's.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_num_seqs: int,
        speculate: int = 0,
        draft: torch.nn.Module | None = None,
        max_adapters: int = 0,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, not {max_num_seqs}")
        if speculate < 0:
            raise ValueError(f"speculate must be 0 (off) or more, not {speculate}")
        self.speculate = speculate
        self.proposed = self.accepted = 0  # speculative tokens proposed and accepted
        self.model = model.eval()
        self.context = model.pos_emb.num_embeddings
        self.cache = KVCache.for_model(model, max_num_seqs)
        self.draft = self.draft_cache = None
        if draft is not None:
            _check_draft(model, draft, speculate)
            self.draft = draft.eval()
            self.draft_cache = KVCache.for_model(draft, max_num_seqs, max_len=self.context)
        self.adapters = AdapterSet(self.model, max_adapters) if max_adapters else None
        self.free = list(range(max_num_seqs - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.forwards = 0  # batched forwards run (prefills + decode steps)
        self.draft_forwards = 0  # the draft's (prompts, then about k per speculative step)
        self.tokens_generated = 0
        self.finished: Counter[str] = Counter()  # sequences ended, by finish reason

    def add(self, prompt: list[int], params: SamplingParams, adapter: int = 0) -> Sequence:
        """Queue a request; it starts at the next step that has a free slot. `adapter`: the
        row the caller acquired from `adapters` for it (0: the model alone), released when the
        sequence ends.

        Raises:
            ValueError: see `check`, or an adapter row without an adapter set.
        """
        self.check(prompt, params)
        if adapter and self.adapters is None:
            raise ValueError("this engine holds no adapters (max_adapters is 0)")
        sequence = Sequence(next(self._ids), list(prompt), params, params.generator())
        sequence.adapter = adapter
        self.waiting.append(sequence)
        return sequence

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming why this request cannot run: an empty prompt, a byte out of
        range, or a prompt plus `max_tokens` longer than the model's context."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < 256 for t in prompt):
            raise ValueError("prompt tokens are bytes: 0-255")
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
        """Admit waiting requests into free slots (prefill), then decode every running one."""
        events = []
        decoding = list(self.running.values())
        if decoding and self.speculate:
            events += self._speculative_step(decoding)
        elif decoding:
            slots = torch.tensor([s.slot for s in decoding])
            last = torch.tensor([[s.output[-1]] for s in decoding])
            self._select(decoding)
            logits = self.model.extend(last, self.cache, slots)[:, -1]
            self.forwards += 1
            events += [self._advance(s, row) for s, row in zip(decoding, logits, strict=True)]
        while self.waiting and self.free:
            sequence = self.waiting.popleft()
            sequence.slot = self.free.pop()
            self.cache.reset(sequence.slot)
            self.running[sequence.id] = sequence
            prompt, slot = torch.tensor([sequence.prompt]), torch.tensor([sequence.slot])
            self._select([sequence])
            logits = self.model.extend(prompt, self.cache, slot)
            self.forwards += 1
            if self.draft is not None:  # the draft reads the prompt too
                self.draft_cache.reset(sequence.slot)
                self.draft.extend(prompt, self.draft_cache, slot)
                self.draft_forwards += 1
            events.append(self._advance(sequence, logits[0, -1]))
        return events

    def _advance(self, sequence: Sequence, logits: torch.Tensor) -> Event:
        sequence.output.append(sample(logits, sequence.params, sequence.generator))
        self.tokens_generated += 1
        _finish_if_done(sequence)
        if sequence.finished:
            self.finished[sequence.finish_reason] += 1
            self._free(sequence)
        return Event(sequence, sequence.release(), sequence.finished)

    def _speculative_step(self, decoding: list[Sequence]) -> list[Event]:
        slots = torch.tensor([s.slot for s in decoding])
        starts = self.cache.lengths[slots].tolist()
        k = min(self.speculate, self.cache.max_len - max(starts) - 1)  # room left in context
        if self.draft is not None:
            proposals, drafted = self._draft_proposals(decoding, slots, k)
        else:
            proposals = [propose_ngram(s.prompt + s.output, k) for s in decoding]
            drafted = [[None] * len(p) for p in proposals]  # proposed for certain
        # No sequence is offered more proposals than it may still generate before its bonus
        # token (max_tokens).
        room = [max(s.params.max_tokens - len(s.output) - 1, 0) for s in decoding]
        proposals = [p[:r] for p, r in zip(proposals, room, strict=True)]
        drafted = [d[:r] for d, r in zip(drafted, room, strict=True)]
        rows = [[s.output[-1], *p, *[s.output[-1]] * (k - len(p))]
                for s, p in zip(decoding, proposals, strict=True)]  # fmt: skip
        self._select(decoding)
        logits = self.model.extend(torch.tensor(rows), self.cache, slots)
        self.forwards += 1
        events = []
        for row, sequence, proposal, draws, start in zip(
            logits, decoding, proposals, drafted, starts, strict=True
        ):
            accepted = checked = 0
            for i in range(len(proposal) + 1):
                if i < len(proposal):
                    ok, token = verify(
                        row[i], proposal[i], sequence.params, sequence.generator, draws[i]
                    )
                    checked += 1
                else:  # past the proposals: the model's own next token
                    ok, token = False, sample(row[i], sequence.params, sequence.generator)
                accepted += ok
                sequence.output.append(token)
                self.tokens_generated += 1
                _finish_if_done(sequence)
                if sequence.finished or not ok:
                    break
            # Acceptance counts the proposals checked (a stop sequence may end the rest).
            self.proposed += checked
            self.accepted += accepted
            if sequence.finished:
                self.finished[sequence.finish_reason] += 1
                self._free(sequence)
            else:  # keep the last token and the accepted proposals; drop the rest
                self.cache.truncate(sequence.slot, start + 1 + accepted)
                if self.draft is not None:  # it never read its last proposal: may lag by one
                    held = int(self.draft_cache.lengths[sequence.slot])
                    self.draft_cache.truncate(sequence.slot, min(held, start + 1 + accepted))
            events.append(Event(sequence, sequence.release(), sequence.finished))
        return events

    def _draft_proposals(self, decoding: list[Sequence], slots: torch.Tensor, k: int):
        """k tokens per sequence from the draft model (about k batched forwards) and, for sampled
        requests, the draft distribution each was drawn from (None for greedy ones). The
        first forward also reads what the draft has not read yet (after an accepted run, its
        last proposal and the bonus token), one forward per lag among the sequences."""
        proposals: list[list[int]] = [[] for _ in decoding]
        drafted: list[list[torch.Tensor | None]] = [[] for _ in decoding]
        first: list[torch.Tensor] = [None] * len(decoding)  # type: ignore[list-item]
        lags: dict[int, list[int]] = {}
        for index, sequence in enumerate(decoding):
            unread = len(sequence.prompt) + len(sequence.output)
            unread -= int(self.draft_cache.lengths[sequence.slot])
            lags.setdefault(unread, []).append(index)
        for unread, members in lags.items():
            rows = [(decoding[i].prompt + decoding[i].output)[-unread:] for i in members]
            group = self.draft.extend(torch.tensor(rows), self.draft_cache, slots[members])
            self.draft_forwards += 1
            for index, row in zip(members, group[:, -1], strict=True):
                first[index] = row
        logits = torch.stack(first)
        for round_ in range(k):
            if round_:
                last = torch.tensor([[mine[-1]] for mine in proposals])
                logits = self.draft.extend(last, self.draft_cache, slots)[:, -1]
                self.draft_forwards += 1
            for sequence, row, mine, draws in zip(
                decoding, logits, proposals, drafted, strict=True
            ):
                if sequence.params.greedy:
                    mine.append(int(row.argmax()))
                    draws.append(None)
                else:
                    q = probabilities(row, sequence.params)
                    mine.append(int(torch.multinomial(q, 1, generator=sequence.generator)))
                    draws.append(q)
        return proposals, drafted

    def _free(self, sequence: Sequence) -> None:
        self.running.pop(sequence.id, None)
        self.cache.reset(sequence.slot)
        if self.draft_cache is not None:
            self.draft_cache.reset(sequence.slot)
        self.free.append(sequence.slot)
        sequence.slot = None
        self._release_adapter(sequence)

    def _select(self, batch: list[Sequence]) -> None:
        """Route the next forward's rows through their sequences' adapters."""
        if self.adapters is not None:
            self.adapters.select([s.adapter for s in batch])

    def _release_adapter(self, sequence: Sequence) -> None:
        if self.adapters is not None:
            self.adapters.release(sequence.adapter)
            sequence.adapter = 0

    def generate(self, prompt: list[int], params: SamplingParams, adapter: int = 0) -> Sequence:
        """Run one request to its end (a convenience around `add` and `step`)."""
        sequence = self.add(prompt, params, adapter)
        while not sequence.finished:
            self.step()
        return sequence


def draft_mismatch(vocab: int, context: int, draft_vocab: int, draft_context: int) -> str | None:
    """Why a draft of `draft_vocab` tokens and `draft_context` positions cannot propose for a
    model of `vocab` and `context`, or None (the same vocabulary, a context at least as long).
    Checked on the modules here and on the registered configs before a deploy."""
    if vocab != draft_vocab:
        return f"the draft's vocabulary is {draft_vocab} tokens, the model's {vocab}"
    if draft_context < context:
        return (
            f"the draft's context ({draft_context} tokens) is shorter than the model's ({context})"
        )
    return None


def _check_draft(model: torch.nn.Module, draft: torch.nn.Module, speculate: int) -> None:
    """Raise ValueError unless `draft` can propose tokens for `model` (speculation on)."""
    if speculate < 1:
        raise ValueError("a draft model needs speculate >= 1 (the tokens it proposes per step)")
    problem = draft_mismatch(
        model.tok_emb.num_embeddings,
        model.pos_emb.num_embeddings,
        draft.tok_emb.num_embeddings,
        draft.pos_emb.num_embeddings,
    )
    if problem:
        raise ValueError(problem)


def propose_ngram(tokens: list[int], k: int, longest: int = 3) -> list[int]:
    """Prompt lookup: the up to `k` tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from `longest` down to 1); none when nothing repeats."""
    if k <= 0:
        return []
    for n in range(min(longest, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@torch.no_grad()
def generate_without_cache(model: torch.nn.Module, prompt: list[int], params: SamplingParams):
    """The reference: every token from a forward over the whole sequence so far (no cache)."""
    context = model.pos_emb.num_embeddings
    if len(prompt) + params.max_tokens > context:
        raise ValueError(f"prompt + max_tokens exceeds the model's context of {context}")
    model.eval()
    tokens, generator = list(prompt), params.generator()
    reference = Sequence(-1, list(prompt), params, generator)
    while not reference.finished:
        logits = model(torch.tensor([tokens]))[0, -1]
        reference.output.append(sample(logits, params, generator))
        tokens.append(reference.output[-1])
        _finish_if_done(reference)
    return reference
