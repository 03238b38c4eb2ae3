"""Speculative decoding: each running sequence proposes k tokens, the model checks them all in
one forward, and the longest accepted run plus one token of the model's own is kept (`verify`):
greedy output is the plain output, sampled output keeps its distribution.

Proposals come from a draft model (`DraftProposer`: a smaller model of the same family and token
ids, a GPT over the same bytes or a Llama-family checkpoint with its target's tokenizer, with its
own cache slots; k batched draft forwards per step, each token drawn from the draft's
distribution under the request's sampling) or from prompt lookup (`propose_ngram`: the k tokens
that followed the last occurrence of the sequence's latest n-gram in its own prompt and
output). Draft proposals stay on the device between the draft's forwards and into the check:
a greedy step reads its values back once, proposals and the model's choices together.
"""

from __future__ import annotations

import torch

from raylane.models.kv_cache import cache_attention_kernels, ints_on, placement
from raylane.serving.generation.model_runner import Launch, ModelRunner
from raylane.serving.generation.model_shape import context_length, new_cache, vocabulary
from raylane.serving.generation.next_token import probabilities, sample, verify
from raylane.serving.generation.sequence import Sequence
from raylane.serving.generation.text_codec import TextCodec


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


def codec_mismatch(codec: TextCodec, draft_codec: TextCodec) -> str | None:
    """Why a draft whose text is `draft_codec`'s ids cannot propose for a model whose text is
    `codec`'s, or None (both bytes, or the same tokenizer vocabulary: a text's ids are the same
    in both, so the model can check the draft's ids as its own)."""
    ours, theirs = codec.token_table(), draft_codec.token_table()
    if ours == theirs:
        return None
    if ours is None or theirs is None:
        draft_reads, model_reads = ("bytes", "a tokenizer's ids")[:: 1 if theirs is None else -1]
        return f"the draft reads {draft_reads}, the model {model_reads}: their token ids differ"
    token = min(set(ours.items()) ^ set(theirs.items()))[0]
    return (
        f"the draft's tokenizer is not the model's (token {token!r}: id {ours.get(token)} in "
        f"the model's, {theirs.get(token)} in the draft's)"
    )


def check_draft(
    model: torch.nn.Module,
    draft: torch.nn.Module,
    speculate: int,
    context: int | None = None,
    codecs: tuple[TextCodec, TextCodec] | None = None,
) -> None:
    """Raise ValueError unless `draft` can propose tokens for `model` (speculation on, the
    same vocabulary, a context at least as long as `context`, the positions the engine lets a
    sequence use (default the model's), the same device), and, given `codecs` (the model's,
    the draft's), the same token ids for the same text (`codec_mismatch`)."""
    if speculate < 1:
        raise ValueError("a draft model needs speculate >= 1 (the tokens it proposes per step)")
    needed = context_length(model) if context is None else context
    problem = draft_mismatch(vocabulary(model), needed, vocabulary(draft), context_length(draft))
    problem = problem or (codec_mismatch(*codecs) if codecs is not None else None)
    if problem:
        raise ValueError(problem)
    if placement(draft)[0] != placement(model)[0]:
        raise ValueError(
            f"the draft is on {placement(draft)[0]}, the model on {placement(model)[0]}"
        )


class DraftProposer:
    """A draft model with a cache slot per engine slot, proposing k tokens per sequence."""

    def __init__(self, draft: torch.nn.Module, slots: int, context: int):
        self.draft = draft.eval()
        self.device, _ = placement(draft)
        self.cache = new_cache(draft, slots, max_len=context)
        self.forwards = 0  # the draft's (prompts, then about k per speculative step)

    def _extend(self, tokens: torch.Tensor, slots: list[int], counts=None) -> torch.Tensor:
        with cache_attention_kernels(self.device):
            logits = self.draft.extend(tokens, self.cache, slots, counts)
        self.forwards += 1
        return logits

    def prefill(self, sequences: list[Sequence]) -> None:
        """Read the prompts of freshly admitted sequences (the draft proposes from them)."""
        for sequence in sequences:
            self.cache.reset(sequence.slot)
        counts = [len(s.prompt) for s in sequences]
        rows = [s.prompt + [0] * (max(counts) - len(s.prompt)) for s in sequences]
        self._extend(ints_on(rows, self.device), [s.slot for s in sequences], counts)

    def reset(self, slot: int) -> None:
        self.cache.reset(slot)

    def settle(self, slot: int, length: int) -> None:
        """After a check kept `length` positions: drop what the draft read past them (it never
        read its last proposal, so it may lag by one)."""
        self.cache.truncate(slot, min(self.cache.lengths[slot], length))

    def propose(self, sequences: list[Sequence], k: int):
        """`(proposals [n, k] on the device, draws)`: k tokens per sequence (about k batched
        forwards) and, for sampled requests, the draft distribution each was drawn from (None
        for greedy ones). The first forward also reads what the draft has not read yet (after
        an accepted run, its last proposal and the bonus token), one forward per lag among the
        sequences. Nothing is read back."""
        slots = [s.slot for s in sequences]
        lags: dict[int, list[int]] = {}
        for index, sequence in enumerate(sequences):
            unread = len(sequence.prompt) + len(sequence.output) - self.cache.lengths[sequence.slot]
            lags.setdefault(unread, []).append(index)
        first: list[torch.Tensor] = [None] * len(sequences)  # type: ignore[list-item]
        for unread, members in lags.items():
            rows = [(sequences[i].prompt + sequences[i].output)[-unread:] for i in members]
            group = self._extend(ints_on(rows, self.device), [slots[i] for i in members])
            for index, row in zip(members, group[:, -1], strict=True):
                first[index] = row
        logits = torch.stack(first)
        picks: list[torch.Tensor] = []
        draws: list[list[torch.Tensor | None]] = [[] for _ in sequences]
        for round_ in range(k):
            if round_:
                logits = self._extend(picks[-1][:, None], slots)[:, -1]
            chosen = logits.argmax(dim=-1)
            for index, sequence in enumerate(sequences):
                if sequence.params.greedy:
                    draws[index].append(None)
                    continue
                q = probabilities(logits[index], sequence.params)
                chosen[index] = torch.multinomial(q, 1, generator=sequence.generator)[0]
                draws[index].append(q)
            picks.append(chosen)
        if not picks:
            return torch.empty(len(sequences), 0, dtype=torch.long, device=self.device), draws
        return torch.stack(picks, dim=1), draws


class Speculator:
    """Speculative steps over a `ModelRunner`: propose, check in one forward, keep the
    accepted run and the model's own next token."""

    def __init__(self, runner: ModelRunner, speculate: int, proposer: DraftProposer | None):
        self.runner = runner
        self.speculate = speculate
        self.proposer = proposer
        self.proposed = self.accepted = 0  # speculative tokens proposed and accepted

    def launch(self, sequences: list[Sequence]) -> Launch:
        """Queue one speculative step for `sequences` (all decoding)."""
        cache, device = self.runner.cache, self.runner.device
        starts = [cache.lengths[s.slot] for s in sequences]
        k = min(self.speculate, cache.max_len - max(starts) - 1)  # room left in context
        # No sequence is offered more proposals than it may still generate before its bonus
        # token (max_tokens): past that, its row repeats its last token.
        room = [max(s.params.max_tokens - len(s.output) - 1, 0) for s in sequences]
        last = [s.output[-1] for s in sequences]
        if self.proposer is not None:
            proposals, draws = self.proposer.propose(sequences, k)
            offered = torch.arange(k, device=device)[None, :] < ints_on(room, device)[:, None]
            lasts = ints_on(last, device)[:, None]
            rows = torch.cat([lasts, torch.where(offered, proposals, lasts)], dim=1)
            looked_up = None
        else:
            looked_up = [propose_ngram(s.prompt + s.output, k)[:r]
                         for s, r in zip(sequences, room, strict=True)]  # fmt: skip
            draws = [[None] * len(p) for p in looked_up]  # proposed for certain
            rows = ints_on([[t, *p, *[t] * (k - len(p))]
                            for t, p in zip(last, looked_up, strict=True)], device)  # fmt: skip
        logits = self.runner.extend(sequences, rows)
        best = logits.argmax(dim=-1)  # [n, k + 1]
        tokens = best if looked_up is not None else torch.cat([proposals, best], dim=1)

        def apply(values: list[list[int]]) -> None:
            for i, sequence in enumerate(sequences):
                if looked_up is not None:
                    proposal, choices = looked_up[i], values[i]
                else:
                    proposal, choices = values[i][:k][: room[i]], values[i][k:]
                self._keep(sequence, proposal, choices, logits[i], draws[i], starts[i])

        return Launch(sequences, tokens, apply)

    def _keep(self, sequence, proposal, choices, logits, draws, start) -> None:
        """Append the accepted run of `proposal` and the model's own token after it (greedy:
        from `choices`, the argmax at each position; sampled: `verify` on `logits`), then drop
        the rejected positions from the caches."""
        params, generator = sequence.params, sequence.generator
        accepted = checked = 0
        for i in range(len(proposal) + 1):
            if i < len(proposal):
                if params.greedy:
                    ok, token = choices[i] == proposal[i], choices[i]
                else:
                    ok, token = verify(logits[i], proposal[i], params, generator, draws[i])
                checked += 1
            else:  # past the proposals: the model's own next token
                ok = False
                token = choices[i] if params.greedy else sample(logits[i], params, generator)
            accepted += ok
            sequence.append(token)
            if sequence.finished or not ok:
                break
        # Acceptance counts the proposals checked (a stop sequence may end the rest).
        self.proposed += checked
        self.accepted += accepted
        if not sequence.finished:  # keep the last token and the accepted proposals
            self.runner.cache.truncate(sequence.slot, start + 1 + accepted)
            if self.proposer is not None:
                self.proposer.settle(sequence.slot, start + 1 + accepted)
