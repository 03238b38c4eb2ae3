"""How the next token is chosen from a model's logits: greedy, or sampled with temperature,
top-k and top-p (nucleus), from a seeded generator so a request repeats exactly.

Torch only (no pydantic): `benchmarks/gpu.py` drives the engine on a machine that has torch
and nothing else, with `Sampling`; a served request's fields are validated first by
`raylane.serving.generation.sampling.SamplingParams`, which the engine reads the same way.

Nothing here reads a value back to the host unless it returns a Python number: the engine
chooses the tokens of a whole batch on the device (`choose_tokens`) and reads them back once
per step. Generators live on the device of the probabilities they draw from (a CUDA draw with
a CPU generator fails).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class SamplingFields(Protocol):
    """What the engine reads of a request's sampling settings (`Sampling`, `SamplingParams`)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: tuple[str, ...]

    @property
    def greedy(self) -> bool: ...


def is_greedy(temperature: float, top_k: int) -> bool:
    """Whether these settings always pick the likeliest token."""
    return temperature == 0.0 or top_k == 1


@dataclass(frozen=True)
class Sampling:
    """Sampling settings for callers without pydantic (benchmarks, scripts); the same fields
    and defaults as `SamplingParams`, whose validation the serving path goes through."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature, self.top_k)


def request_generator(params: SamplingFields, device: torch.device) -> torch.Generator | None:
    """A request's own random stream on `device` (None when greedy or unseeded: the device's
    default stream). Streams differ between devices: a seed repeats on the same kind."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def probabilities(logits: torch.Tensor, params: SamplingFields) -> torch.Tensor:
    """The distribution `[vocab]` a non-greedy request samples from: temperature, then
    top-k, then top-p applied to `logits` (no host read: masks, not boolean indexing)."""
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        each = torch.softmax(ordered, dim=-1)
        # Keep a token while the mass before it is under top_p: the likeliest always stays.
        drop_sorted = (each.cumsum(dim=-1) - each) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def draw(logits: torch.Tensor, params: SamplingFields, generator=None) -> torch.Tensor:
    """The next token of one sequence as a 0-d tensor on the logits' device (no host read)."""
    if params.greedy:
        return logits.argmax()
    return torch.multinomial(probabilities(logits, params), 1, generator=generator)[0]


def sample(logits: torch.Tensor, params: SamplingFields, generator=None) -> int:
    """The next token for one sequence from its logits `[vocab]` (one host read)."""
    return int(draw(logits, params, generator))


def choose_tokens(
    logits: torch.Tensor, params: list[SamplingFields], generators: list
) -> torch.Tensor:
    """The next token of every row of `logits` `[n, vocab]`, as `[n]` on their device: one
    argmax for the batch, then a draw per sampled row from its own generator, so a row gets
    what `sample` gives it alone. Nothing is read back: the caller reads once per step."""
    tokens = logits.argmax(dim=-1)
    for row, (settings, generator) in enumerate(zip(params, generators, strict=True)):
        if not settings.greedy:
            tokens[row] = draw(logits[row], settings, generator)
    return tokens


def verify(
    logits: torch.Tensor,
    proposed: int,
    params: SamplingFields,
    generator=None,
    draft: torch.Tensor | None = None,
):
    """Speculative decoding's check of one proposed token against the target's logits:
    `(accepted, token)`. Greedy: accepted when it is the argmax, else the argmax. Sampled:
    `draft` is the distribution q the proposal was drawn from (None: proposed for certain, as
    by prompt lookup); accepted with probability min(1, p/q) at the proposed token, else a
    token drawn from max(p - q, 0) renormalised. The tokens so chosen are distributed as
    `sample` would draw them (Leviathan et al. 2023, Chen et al. 2023). The sampled check
    reads values back (its branches decide which draws follow)."""
    if params.greedy:
        best = int(logits.argmax())
        return best == proposed, best
    p = probabilities(logits, params)
    q = torch.zeros_like(p) if draft is None else draft.float()
    if draft is None:
        q[proposed] = 1.0
    uniform = torch.rand((), generator=generator, device=p.device)
    if float(uniform) * float(q[proposed]) < float(p[proposed]):
        return True, proposed
    rest = (p - q).clamp(min=0.0)
    if float(rest.sum()) <= 0.0:  # p is q: nothing to correct
        return True, proposed
    return False, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
