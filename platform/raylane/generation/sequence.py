"""One request as the engine holds it: prompt, output so far, place in the cache, and what it
hands out (text held back while it might still be the start of a stop sequence).

Tokens are bytes (the GPT's vocabulary is 256): the text a sequence releases is bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raylane.generation.next_token import SamplingFields


@dataclass(eq=False)
class Sequence:
    """One request's prompt, output so far and place in the cache."""

    id: int
    prompt: list[int]
    params: SamplingFields
    generator: torch.Generator | None = None  # on the model's device (None: its default)
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
            hold = max((held_back(data, s.encode()) for s in self.params.stop), default=0)
            data = data[: len(data) - hold]
        new = data[self.released :]
        self.released = len(data)
        return new

    def append(self, token: int) -> None:
        """Add a generated token and mark the sequence finished if it now ends with a stop
        sequence or is long enough."""
        self.output.append(token)
        for stop in (s.encode() for s in self.params.stop):
            if bytes(self.output[-len(stop) :]) == stop:
                self.finish_reason, self.stopped_by = "stop", stop
                return
        if len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"


def held_back(data: bytes, stop: bytes) -> int:
    """Length of the longest end of `data` that a stop sequence starts with."""
    for size in range(min(len(stop) - 1, len(data)), 0, -1):
        if data.endswith(stop[:size]):
            return size
    return 0


@dataclass(frozen=True)
class Event:
    """What one step did for one sequence: its new releasable bytes, and whether it ended."""

    sequence: Sequence
    text: bytes
    finished: bool
