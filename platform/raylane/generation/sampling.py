"""How the next token is chosen from a model's logits: greedy, or sampled with temperature,
top-k and top-p (nucleus), from a seeded generator so a request repeats exactly."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """What one generation request asks for (the OpenAI completion fields raylane honours)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="Tokens (bytes) to generate at most.")
    temperature: float = Field(
        1.0, ge=0.0, le=2.0, description="0 is greedy; higher flattens the distribution."
    )
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens (0: all).")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Sample among the likeliest tokens holding this mass."
    )
    seed: int | None = Field(None, description="Seed of this request's sampling (repeatable).")
    stop: tuple[str, ...] = Field(
        (), max_length=4, description="Generation ends before the first of these strings."
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_many(cls, value):
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop sequences must not be empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def generator(self) -> torch.Generator | None:
        """This request's own random stream (None when greedy or unseeded)."""
        if self.greedy or self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `[vocab]` a non-greedy request samples from: temperature, then
    top-k, then top-p applied to `logits`."""
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        each = torch.softmax(ordered, dim=-1)
        # Keep a token while the mass before it is under top_p: the likeliest always stays.
        drop = (each.cumsum(dim=-1) - each) >= params.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator=None) -> int:
    """The next token for one sequence from its logits `[vocab]`."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def verify(
    logits: torch.Tensor,
    proposed: int,
    params: SamplingParams,
    generator=None,
    draft: torch.Tensor | None = None,
):
    """Speculative decoding's check of one proposed token against the target's logits:
    `(accepted, token)`. Greedy: accepted when it is the argmax, else the argmax. Sampled:
    `draft` is the distribution q the proposal was drawn from (None: proposed for certain, as
    by prompt lookup); accepted with probability min(1, p/q) at the proposed token, else a
    token drawn from max(p - q, 0) renormalised. The tokens so chosen are distributed as
    `sample` would draw them (Leviathan et al. 2023, Chen et al. 2023)."""
    if params.greedy:
        best = int(logits.argmax())
        return best == proposed, best
    p = probabilities(logits, params)
    q = torch.zeros_like(p) if draft is None else draft.float()
    if draft is None:
        q[proposed] = 1.0
    if float(torch.rand((), generator=generator)) * float(q[proposed]) < float(p[proposed]):
        return True, proposed
    rest = (p - q).clamp(min=0.0)
    if float(rest.sum()) <= 0.0:  # p is q: nothing to correct
        return True, proposed
    return False, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
