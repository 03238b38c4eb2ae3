"""OpenAI-compatible completion messages (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`) and the Open Inference Protocol's generate extension, for a byte-level GPT.

Text is UTF-8: a prompt's bytes are the model's tokens, and the bytes it generates are decoded
incrementally, so a streamed chunk never ends inside a multi-byte character. Token counts in
`usage` are bytes. Fields OpenAI defines that raylane cannot honour (`n > 1`, `logprobs`,
penalties, `best_of`) are refused with a sentence naming them, never silently ignored; fields
that change nothing here (`user`) are accepted.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raylane.generation.sampling import SamplingParams
from raylane.serving.errors import ProtocolError


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served model's id (`serving.model_name`).")
    max_tokens: int | None = Field(None, description="Bytes to generate at most.")
    max_completion_tokens: int | None = Field(None, description="Chat's name for max_tokens.")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="Extension (as vLLM): sample among the k likeliest.")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, description="Only 1: one choice per request.")
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        refused = {
            "n": self.n != 1,
            "logprobs": bool(self.logprobs),
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
        }
        named = [name for name, bad in refused.items() if bad]
        if named:
            raise ValueError(f"not supported by this server: {', '.join(named)}")
        return self

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        given = [n for n in (self.max_completion_tokens, self.max_tokens) if n is not None]
        max_tokens = given[0] if given else default_max_tokens
        fields = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
        }
        try:
            return SamplingParams(**fields)
        except ValidationError as exc:
            raise ProtocolError(first_error(exc)) from None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(description="The text to continue (one prompt).")
    echo: bool = False
    best_of: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (a list must hold exactly one)")
        if self.best_of not in (None, 1):
            raise ValueError("not supported by this server: best_of")
        return self

    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)

    def text(self) -> str:
        """The conversation as the byte-level model sees it: one `role: content` line per
        message, then `assistant: ` for the reply (the model has no chat template)."""
        lines = [f"{m.role}: {m.content}\n" for m in self.messages]
        return "".join(lines) + "assistant: "


class GenerateRequest(BaseModel):
    """OIP generate extension: `{"text_input": ..., "parameters": {...}}`."""

    model_config = ConfigDict(extra="forbid")

    text_input: str
    parameters: dict = Field(default_factory=dict)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        fields = {"max_tokens": default_max_tokens, **self.parameters}
        try:
            return SamplingParams(**fields)
        except ValidationError as exc:
            raise ProtocolError("parameters." + first_error(exc)) from None


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """`model` from a JSON body, or `ProtocolError` (400) naming the first problem."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(first_error(exc)) from None


def first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    message = first["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def prompt_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class TextStream:
    """Bytes to text, holding back an incomplete UTF-8 character until its last byte."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes, final: bool = False) -> str:
        return self._decoder.decode(data, final=final)


def completion_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(
    kind: str, request_id: str, model: str, text: str, finish: str | None, use: dict | None
) -> dict:
    """A `text_completion` / `chat.completion` object, or one of their stream chunks
    (`kind` ending in `.chunk`)."""
    chat = kind.startswith("chat")
    chunk = kind.endswith(".chunk")
    if chat:
        key = "delta" if chunk else "message"
        choice = {"index": 0, key: {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = finish
    body = {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if use is not None:
        body["usage"] = use
    return body


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def openai_error(message: str, status: int) -> dict:
    kinds = {401: "authentication_error", 404: "not_found_error", 503: "server_overloaded"}
    return {
        "error": {
            "message": message,
            "type": kinds.get(status, "invalid_request_error"),
            "param": None,
            "code": None,
        }
    }
