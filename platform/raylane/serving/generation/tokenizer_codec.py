"""A Llama-family model's own tokenizer as a text codec (`raylane.serving.generation.text_codec`): a
Hugging Face `tokenizer.json` read by the data path (`raylane.data.tokenizer`), the ids that end
a generation, and the chat template of the checkpoint's tokenizer_config.json, compiled by the
data path's `ChatTemplate` and rendered for a reply as `transformers` renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from raylane.data.chat import BadRow, ChatTemplate
from raylane.data.tokenizer import Tokenizer, load_tokenizer, single_threaded
from raylane.serving.generation.text_codec import IncrementalDetokenizer


@dataclass(frozen=True)
class TokenizerCodec:
    """A Hugging Face tokenizer (`raylane.data.tokenizer.Tokenizer`), the ids that end a
    generation, and the checkpoint's chat template (None: the server's plain rendering)."""

    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    chat: ChatTemplate | None = field(default=None, compare=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return self.chat is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; special-token text in it (`<|eot_id|>`) is that token, and the
        tokenizer's post-processor adds its own (a BOS) under `add_special_tokens`."""
        with single_threaded():
            return self.tokenizer.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def detokenizer(self, prompt: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer.hf, prompt)

    def stop_text(self, stop: str) -> str:
        return stop

    def id_range_error(self) -> str:
        return f"prompt token ids lie in 0-{self.vocab_size - 1}"

    def token_table(self) -> dict[str, int]:
        """The tokenizer's vocabulary, its added (special) tokens included."""
        return self.tokenizer.hf.get_vocab(with_added_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        """The conversation as the chat template renders it before the reply, as
        `transformers`' `apply_chat_template(..., add_generation_prompt=True)` does.

        Raises:
            ValueError: the codec has no chat template, or the template refused the messages.
        """
        if self.chat is None:
            raise ValueError("this model's tokenizer has no chat template")
        try:  # the data path's compiled template, rendered for a reply instead of training
            return self.chat.render(messages, add_generation_prompt=True)
        except BadRow as exc:
            raise ValueError(str(exc)) from None

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The ids of `render_chat` (the template writes any BOS itself)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def load_codec(directory: str | Path) -> TokenizerCodec:
    """The codec of a Hugging Face checkpoint directory: its tokenizer.json, and beside it
    tokenizer_config.json (eos and bos tokens, chat template), generation_config.json and
    config.json (their `eos_token_id`s, an int or a list, all of which end a generation).

    Raises:
        raylane.data.errors.DataError: no tokenizer.json, or one without an end-of-text token.
    """
    directory = Path(directory)
    tokenizer = load_tokenizer(directory / "tokenizer.json")
    eos = {tokenizer.eot_id}
    for name in ("generation_config.json", "config.json"):
        eos |= _eos_ids(directory / name)
    chat = None
    if tokenizer.chat_template is not None:
        chat = ChatTemplate(
            tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eot_token
        )
    return TokenizerCodec(tokenizer, frozenset(eos), chat)


def _eos_ids(path: Path) -> set[int]:
    """A config file's `eos_token_id` (an int, a list of ints, or absent) as a set."""
    if not path.is_file():
        return set()
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return set()
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int)}
