"""The tokenizers of `data.source: files`: bytes, a Hugging Face `tokenizer.json`, or a byte-level
BPE trained here, deterministically, with the `tokenizers` library.

Every tokenizer has an end-of-text token, which ends each document in the packed stream: for
bytes it is byte 3 (ASCII "end of text"), so byte-level models keep their 256 classes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.data.errors import DataError

#: The end-of-text token of a trained BPE.
END_OF_TEXT = "<|endoftext|>"
#: Byte 3, ASCII ETX ("end of text"): the end-of-text token of the bytes tokenizer.
BYTES_END_OF_TEXT = 3
#: tokenizers' switch for its thread pool. A corpus is encoded on every core: raylane sets it
#: to "true" then, unless it is set already (a user's "false" keeps one thread), so that a
#: process forked later (Ray starting its own) neither warns nor turns the pool off.
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
#: End-of-text tokens looked for in a given tokenizer.json, after its tokenizer_config.json's
#: `eos_token`.
KNOWN_END_OF_TEXT = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


@dataclass(frozen=True)
class Tokenizer:
    """The configured tokenizer. `hf` is a `tokenizers.Tokenizer`, None for bytes."""

    kind: str  # "bytes", "trained-bpe" or "file"
    vocab_size: int  # ids lie in [0, vocab_size)
    eot_id: int
    eot_token: str
    hf: Any = None
    path: Path | None = None  # the tokenizer.json it was read from (kind "file")
    chat_template: str | None = None  # from a tokenizer_config.json beside that file
    bos_token: str = ""

    def encode_batch(self, texts: list[str], special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text, without special tokens added. Special-token text in the texts
        (`<|endoftext|>`, `<|im_end|>`) is the special token under `special_tokens` (a chat
        template's own text), else ordinary text (the data's text, which so cannot end a document
        or a turn). Bytes: every text is its UTF-8 bytes, whatever `special_tokens` says."""
        if self.hf is None:
            return [list(text.encode("utf-8")) for text in texts]
        before = self.hf.encode_special_tokens
        self.hf.encode_special_tokens = not special_tokens  # True: special tokens as plain text
        # A corpus on every core (see PARALLELISM_ENV); encoding is the same on any number.
        os.environ.setdefault(PARALLELISM_ENV, "true")
        try:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        finally:
            self.hf.encode_special_tokens = before

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens included."""
        ids = [int(i) for i in ids]
        if self.hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=False)

    def file_bytes(self) -> bytes | None:
        """What `tokenizer.json` beside the splits holds: the given file's own bytes, the trained
        tokenizer's JSON, nothing for bytes."""
        if self.path is not None:
            return self.path.read_bytes()
        return None if self.hf is None else self.hf.to_str(pretty=True).encode()

    def describe(self) -> dict:
        """The manifest's record of the tokenizer."""
        content = self.file_bytes()
        return {
            "kind": self.kind,
            "path": None if self.path is None else str(self.path),
            "sha256": None if content is None else hashlib.sha256(content).hexdigest(),
            "vocab_size": self.vocab_size,
            "end_of_text": {"token": self.eot_token, "id": self.eot_id},
        }


BYTES = Tokenizer(kind="bytes", vocab_size=256, eot_id=BYTES_END_OF_TEXT, eot_token="\x03")


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """`tokenizers` on one thread: the same BPE whatever the machine, and no thread pool left
    behind to warn when Ray forks later."""
    before = os.environ.get(PARALLELISM_ENV)
    os.environ[PARALLELISM_ENV] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[PARALLELISM_ENV]
        else:
            os.environ[PARALLELISM_ENV] = before


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (the 256 bytes, `END_OF_TEXT`, merges)
    trained on `texts`, deterministically: fixed settings, one thread."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with single_threaded():
        hf.train_from_iterator(texts, trainer)
    return _wrap(hf, "trained-bpe", END_OF_TEXT)


def load_tokenizer(path: Path) -> Tokenizer:
    """A Hugging Face tokenizer.json, with the end-of-text token, BOS token and chat template
    of a tokenizer_config.json beside it (when there is one)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.tokenizer: {path} not found")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclasses
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: not a Hugging Face tokenizer.json ({reason})") from None
    config = tokenizer_config(path)
    candidates = [_token_text(config.get("eos_token")), *KNOWN_END_OF_TEXT]
    eot = next((c for c in candidates if c and hf.token_to_id(c) is not None), None)
    if eot is None:
        raise DataError(
            f"{path}: no end-of-text token (tokenizer_config.json's eos_token, or one of "
            f"{', '.join(KNOWN_END_OF_TEXT)})"
        )
    return _wrap(
        hf,
        "file",
        eot,
        path=path,
        chat_template=_chat_template(config.get("chat_template")),
        bos_token=_token_text(config.get("bos_token")) or "",
    )


def tokenizer_config(path: Path) -> dict:
    """The tokenizer_config.json beside a tokenizer.json, `{}` when there is none."""
    config = Path(path).parent / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        loaded = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{config}: not valid JSON ({exc})") from None
    return loaded if isinstance(loaded, dict) else {}


def check_vocabulary(tokenizer: Tokenizer, num_classes: int) -> None:
    """Every token id must be a class of the model."""
    if tokenizer.vocab_size > num_classes:
        where = tokenizer.path or "the trained tokenizer"
        raise DataError(
            f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but model.num_classes is "
            f"{num_classes}; set model.num_classes to at least {tokenizer.vocab_size}"
        )


def _wrap(hf: Any, kind: str, eot: str, **details: Any) -> Tokenizer:
    """A `tokenizers.Tokenizer` as a `Tokenizer`: its ids lie below one more than the largest
    (added tokens included)."""
    vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(kind, vocab_size, hf.token_to_id(eot), eot, hf=hf, **details)


def _token_text(token: Any) -> str | None:
    """A tokenizer_config.json token: a string, or an object with its `content`."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _chat_template(template: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates (the default)."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None
