"""Chat rows (`messages`: a list of `{role, content}`) rendered to text by a Jinja chat template,
as pieces that say which text the model learns: the assistants' contents, nothing else.

The template is rendered twice: once with each content replaced by a marker, to find where the
template puts it, and once as it is, to check that putting the contents at the markers gives the
same text (a template that rewrites contents is refused rather than masked wrongly). Each
content stays a piece of its own, so only the template's text can hold special tokens.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from raylane.data.errors import DataError

#: The roles a message may have.
ROLES = ("system", "user", "assistant")

#: raylane's chat template: each message as `<|ROLE|>`, a newline and its content, the messages
#: separated by a newline (`<|user|>\nHi\n<|assistant|>\nHello`). Rendered like Hugging Face's
#: templates (trim_blocks, lstrip_blocks), hence the newlines as expressions.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "<|{{ message.role }}|>{{ '\\n' }}{{ message.content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n' }}<|assistant|>{{ '\\n' }}{% endif %}"
)


class Piece(NamedTuple):
    """A piece of a document: its text, whether the model learns it (its tokens are labels) or
    only reads it (labels -100), and whether it is the chat template's own text. Only template
    text turns special-token text (`<|im_start|>`, the eos token) into special tokens; in the
    data's own text (contents, text fields, files) it is ordinary text."""

    text: str
    learnt: bool
    template: bool = False


_MARKER = re.compile("\ue000raylane-content-(\\d+)\ue001")


class BadRow(ValueError):
    """A row that cannot become a document; the message names the field, not the file."""


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (`object`, `array`, `string`, ...)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def check_messages(messages: Any) -> list[dict]:
    """`messages` if it is a non-empty list of `{role, content}` with known roles and string
    contents and at least one assistant message, else `BadRow` naming the first problem."""
    if not isinstance(messages, list) or not messages:
        raise BadRow(f"'messages' must be a non-empty array, found {json_type(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRow(f"messages[{i}] must be an object, found {json_type(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise BadRow(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            found = json_type(message.get("content"))
            raise BadRow(f"messages[{i}].content must be a string, found {found}")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise BadRow("'messages' has no assistant content to learn")
    return messages


class ChatTemplate:
    """A compiled chat template that turns a row's `messages` into pieces."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        # lazy: only chat rows need Jinja
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as exc:
            raise DataError(f"data.chat_template: {exc.message} (line {exc.lineno})") from None
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self.source = source

    def __reduce__(self) -> tuple:
        # Compiled Jinja does not pickle; Ray Data's workers compile the source again.
        return (_compiled, (self.source, self._tokens["bos_token"], self._tokens["eos_token"]))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it; with `add_generation_prompt`, followed
        by what opens the assistant's reply (as `transformers`' `apply_chat_template`).

        Raises:
            BadRow: the template refused the messages (its `raise_exception`, or an error).
        """
        from jinja2 import TemplateError  # lazy: only chat rows need Jinja

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._tokens
            )
        except TemplateError as exc:
            raise BadRow(f"chat_template: {exc}") from None

    def pieces(self, messages: Any) -> tuple[Piece, ...]:
        """The rendered conversation as pieces, the assistants' contents the learnt ones."""
        messages = check_messages(messages)
        marked = [
            {**m, "content": f"\ue000raylane-content-{i}\ue001"} for i, m in enumerate(messages)
        ]
        layout = _MARKER.split(self.render(marked))
        text = self.render(messages)
        # A template may trim contents (Hugging Face's often do): try them as they are, then so.
        learnt = [m["role"] == "assistant" for m in messages]
        verbatim = [m["content"] for m in messages]
        stop = self._tokens["eos_token"]
        for contents in (verbatim, [content.strip() for content in verbatim]):
            pieces = _fill(layout, contents, learnt, stop)
            if "".join(piece.text for piece in pieces) == text:
                return pieces
        raise BadRow("chat_template does not render the messages' contents verbatim")


def _fill(
    layout: list[str], contents: list[str], learnt: list[bool], stop: str = ""
) -> tuple[Piece, ...]:
    """`layout` (template text and marker numbers, alternating) with the contents put in, each
    content a piece of its own, never joined with template text.

    The template text right after a learnt content is learnt up to and including the first
    `stop` (the tokenizer's end-of-sequence token, e.g. `<|im_end|>` or `<|eot_id|>`), so a
    model fine-tuned on chat learns to end its turn as the template ends it."""
    pieces: list[Piece] = []
    after_learnt = False
    for position, part in enumerate(layout):
        if position % 2:
            index = int(part)
            new = [Piece(contents[index], learnt[index])]
            after_learnt = learnt[index]
        else:
            cut = part.find(stop) + len(stop) if after_learnt and stop and stop in part else 0
            new = [Piece(part[:cut], True, True), Piece(part[cut:], False, True)]
            after_learnt = False
        for piece in new:
            if not piece.text:
                continue
            if pieces and pieces[-1][1:] == piece[1:]:  # learnt and template alike
                pieces[-1] = piece._replace(text=pieces[-1].text + piece.text)
            else:
                pieces.append(piece)
    return tuple(pieces)


def _compiled(source: str, bos_token: str, eos_token: str) -> ChatTemplate:
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)
