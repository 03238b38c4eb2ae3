"""A generation request's sampling settings, validated (greedy, or sampled with temperature,
top-k and top-p from a seeded generator so a request repeats exactly).

How tokens are then chosen is `raylane.serving.generation.next_token` (torch only); its functions
are re-exported here for the callers that import them from this module.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from raylane.serving.generation.next_token import is_greedy, probabilities, sample, verify

__all__ = ["SamplingParams", "probabilities", "sample", "verify"]


class SamplingParams(BaseModel):
    """What one generation request asks for (the OpenAI completion fields raylane honours)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(
        16, ge=1, description="Tokens to generate at most (bytes for a byte-level GPT)."
    )
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
        return is_greedy(self.temperature, self.top_k)
