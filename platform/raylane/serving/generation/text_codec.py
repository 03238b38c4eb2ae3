"""Text to token ids and back, as a served model reads and writes it.

Two codecs: `BYTES`, the byte-level GPT's (a prompt's UTF-8 bytes are its tokens, the text a
sequence releases is bytes, decoded by the server as a UTF-8 stream), and
`raylane.serving.generation.tokenizer_codec.TokenizerCodec`, a Hugging Face `tokenizer.json` with
the end-of-sequence ids and chat template of the checkpoint around it (a Llama-family model's own
tokenizer). This module needs nothing but the standard library: the engine imports it, and runs
where only torch is installed (`benchmarks/gpu.py`).

A sequence decodes its output incrementally (`Detokenizer`) and releases only text that is
final. For a tokenizer this follows vLLM's `detokenize_incrementally`: decode a window of the
ids from a prefix offset on, and emit what it adds beyond the window's first part, but only
once it no longer ends in U+FFFD (a character whose bytes are split over tokens not complete
yet). Decoding a window rather than one token at a time keeps the spaces and merges that a
decoder (byte-level, SentencePiece's `▁`) derives from neighbouring tokens; the window starts a
few ids into the prompt, so the first output word keeps its leading space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

#: Prompt ids the first decoding window starts with (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION
#: _OFFSET): enough context for a decoder to place the first output token's leading space.
PROMPT_CONTEXT = 5
REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    """One sequence's output ids to text, handed out only once final."""

    empty: bytes | str

    def feed(self, token: int) -> bytes | str:
        """The text that `token` makes final (empty while it may still change)."""
        ...

    def flush(self) -> bytes | str:
        """The text still held back, at the sequence's end."""
        ...


class TextCodec(Protocol):
    """How a served model's text becomes token ids and its output ids become text."""

    vocab_size: int  # prompt ids lie in [0, vocab_size)
    eos_ids: frozenset[int]  # generation stops at these ids (never emitted as text)
    has_chat_template: bool

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def detokenizer(self, prompt: list[int]) -> Detokenizer: ...

    def stop_text(self, stop: str) -> bytes | str:
        """A stop string in the form the detokenizer's text takes."""
        ...

    def id_range_error(self) -> str: ...

    def token_table(self) -> dict[str, int] | None:
        """Each token's text and id (None: the ids are bytes): two codecs with the same table
        give the same text the same ids (a draft model's must be its target's)."""
        ...


class ByteDetokenizer:
    """Bytes are final as they come: the text is the output's bytes (decoded by the reader)."""

    empty = b""

    def feed(self, token: int) -> bytes:
        return bytes((token,))

    def flush(self) -> bytes:
        return b""


@dataclass(frozen=True)
class BytesCodec:
    """The byte-level GPT's codec: tokens are UTF-8 bytes, no end-of-sequence id, no template."""

    vocab_size: int = 256
    eos_ids: frozenset[int] = frozenset()
    has_chat_template: bool = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenizer(self, prompt: list[int]) -> ByteDetokenizer:
        return ByteDetokenizer()

    def stop_text(self, stop: str) -> bytes:
        return stop.encode("utf-8")

    def id_range_error(self) -> str:
        return "prompt tokens are bytes: 0-255"

    def token_table(self) -> None:
        return None


BYTES = BytesCodec()


class IncrementalDetokenizer:
    """vLLM's incremental detokenization over a `tokenizers.Tokenizer` (special tokens
    skipped, as in the text a server returns)."""

    empty = ""

    def __init__(self, hf: Any, prompt: list[int]):
        self.hf = hf
        self.ids = list(prompt[-PROMPT_CONTEXT:])
        self.prefix = 0  # where the decoding window starts
        self.read = len(self.ids)  # ids before this are in the text handed out

    def _decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def feed(self, token: int) -> str:
        self.ids.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(before) and not final:
            return ""
        if window.endswith(REPLACEMENT) and not final:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(before) :]
