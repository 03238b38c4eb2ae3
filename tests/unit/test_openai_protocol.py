"""OpenAI-compatible request checks and response shapes (no server)."""

from __future__ import annotations

import json

import pytest

from raylane.serving.errors import ProtocolError
from raylane.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    TextStream,
    completion_body,
    parse,
    sse,
)


def _body(**fields) -> bytes:
    return json.dumps({"model": "pylm", **fields}).encode()


def test_a_completion_request_becomes_sampling_params():
    request = parse(
        CompletionRequest,
        _body(prompt="def f(", max_tokens=9, temperature=0, stop="\n", seed=3, user="u1"),
    )
    params = request.sampling(default_max_tokens=64)
    assert request.text() == "def f(" and params.max_tokens == 9 and params.greedy
    assert params.stop == ("\n",) and params.seed == 3
    assert parse(CompletionRequest, _body(prompt=["x"])).sampling(64).max_tokens == 64


def test_chat_messages_become_one_role_tagged_prompt():
    request = parse(
        ChatCompletionRequest,
        _body(
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_completion_tokens=5,
        ),
    )
    assert request.text() == "system: be brief\nuser: hi\nassistant: "
    assert request.sampling(64).max_tokens == 5


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "the body is not JSON"),
        (b"[1, 2]", "the body must be a JSON object"),
        (_body(), "prompt: Field required"),
        (_body(prompt="a", n=2), "not supported by this server: n"),
        (_body(prompt="a", logprobs=2), "not supported by this server: logprobs"),
        (_body(prompt="a", frequency_penalty=0.5), "frequency_penalty"),
        (_body(prompt=["a", "b"]), "one prompt per request"),
        (_body(prompt="a", best_of=3), "best_of"),
        (_body(prompt="a", suffix="b"), "suffix: Extra inputs are not permitted"),
    ],
)
def test_bad_completion_requests_name_the_problem(body, message):
    with pytest.raises(ProtocolError, match=message) as caught:
        parse(CompletionRequest, body)
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"temperature": 5}, "temperature: Input should be less than or equal to 2"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_sampling_fields_are_a_400_naming_the_field(fields, message):
    request = parse(CompletionRequest, _body(prompt="a", **fields))
    with pytest.raises(ProtocolError, match=message):
        request.sampling(16)


def test_chat_needs_a_message_with_a_known_role():
    with pytest.raises(ProtocolError, match="messages: List should have at least 1 item"):
        parse(ChatCompletionRequest, _body(messages=[]))
    with pytest.raises(ProtocolError, match="messages.0.role"):
        parse(ChatCompletionRequest, _body(messages=[{"role": "robot", "content": "x"}]))


def test_generate_extension_parameters_are_checked():
    request = parse(GenerateRequest, b'{"text_input": "x", "parameters": {"max_tokens": 4}}')
    assert request.sampling(16).max_tokens == 4
    with pytest.raises(ProtocolError, match="parameters.beam_width: Extra inputs"):
        parse(GenerateRequest, b'{"text_input": "x", "parameters": {"beam_width": 2}}').sampling(8)


def test_a_multi_byte_character_is_never_split_across_chunks():
    stream = TextStream()
    data = "é→ok".encode()  # 2 + 3 + 2 bytes
    chunks = [stream.feed(data[i : i + 1]) for i in range(len(data))]
    assert chunks == ["", "é", "", "", "→", "o", "k"]
    assert stream.feed(b"\xe2", final=True) == "\ufffd"  # a cut-off character at the very end


def test_response_shapes_follow_openai():
    text = completion_body("text_completion", "cmpl-1", "pylm", "abc", "length", {"x": 1})
    assert text["choices"][0] == {
        "index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"
    }  # fmt: skip
    assert text["object"] == "text_completion" and text["usage"] == {"x": 1}
    chunk = completion_body("chat.completion.chunk", "c-1", "pylm", "a", None, None)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert "usage" not in chunk
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse({"a": 1})[6:]) == {"a": 1}
