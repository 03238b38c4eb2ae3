"""One request as the engine holds it: prompt, output so far, place in the cache, and what it
hands out (text held back while it might still be the start of a stop sequence).

The output is token ids; its text comes from the sequence's `Detokenizer`
(`raylane.serving.generation.text_codec`): bytes for the byte-level GPT (its tokens are bytes), text
for a model with a tokenizer. Stop sequences are matched on that text, and an end-of-sequence
id ends the output without adding text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raylane.serving.generation.next_token import SamplingFields
from raylane.serving.generation.text_codec import BYTES, Detokenizer, TextCodec


@dataclass(eq=False)
class Sequence:
    """One request's prompt, output so far and place in the cache."""

    id: int
    prompt: list[int]
    params: SamplingFields
    generator: torch.Generator | None = None  # on the model's device (None: its default)
    codec: TextCodec = BYTES
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    stopped_by: bytes | str = b""  # the stop sequence that ended the output
    released: int = 0  # text handed out so far (bytes or characters)
    adapter: int = 0  # row of its LoRA adapter in the engine's `AdapterSet` (0: none)
    detokenizer: Detokenizer = field(init=False)
    decoded: bytes | str = field(init=False)  # the final text so far, cut at a stop sequence
    stops: tuple = field(init=False)  # the stop sequences in the detokenizer's text form

    def __post_init__(self) -> None:
        self.detokenizer = self.codec.detokenizer(self.prompt)
        self.decoded = self.detokenizer.empty
        self.stops = tuple(self.codec.stop_text(s) for s in self.params.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> bytes | str:
        """The output's text without a stop sequence that ended it (or anything after it)."""
        return self.decoded

    def release(self) -> bytes | str:
        """Text not handed out before and no longer possibly part of a stop sequence."""
        data = self.decoded
        if not self.finished:
            hold = max((held_back(data, stop) for stop in self.stops), default=0)
            data = data[: len(data) - hold]
        new = data[self.released :]
        self.released = len(data)
        return new

    def append(self, token: int) -> None:
        """Add a generated token and mark the sequence finished if it is an end-of-sequence
        id, its text now holds a stop sequence, or the output is long enough."""
        self.output.append(token)
        if token in self.codec.eos_ids:
            self.finish_reason = "stop"
            self._take(self.detokenizer.flush())
            return
        if self._take(self.detokenizer.feed(token)):
            return
        if len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"
            self._take(self.detokenizer.flush())

    def _take(self, new: bytes | str) -> bool:
        """Add final text; True (and finished) if a stop sequence now appears in the text, which
        is cut where the first one starts."""
        if not new:
            return False
        start = len(self.decoded)
        self.decoded += new
        found = []
        for stop in self.stops:
            at = self.decoded.find(stop, max(0, start - len(stop) + 1))
            if at >= 0:
                found.append((at, stop))
        if not found:
            return False
        at, stop = min(found, key=lambda pair: pair[0])
        self.decoded, self.stopped_by = self.decoded[:at], stop
        self.finish_reason = "stop"
        return True


def held_back(data: bytes | str, stop: bytes | str) -> int:
    """Length of the longest end of `data` that a stop sequence starts with."""
    for size in range(min(len(stop) - 1, len(data)), 0, -1):
        if data.endswith(stop[:size]):
            return size
    return 0


@dataclass(frozen=True)
class Event:
    """What one step did for one sequence: its new releasable text (bytes for the byte-level
    GPT), and whether it ended."""

    sequence: Sequence
    text: bytes | str
    finished: bool
