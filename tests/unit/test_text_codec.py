"""The text codecs generation serves through: incremental detokenization against a whole
decode, end-of-sequence ids, and chat templates rendered as `transformers` renders them."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import transformers

from raylane.data.tokenizer import END_OF_TEXT, train_bpe
from raylane.serving.generation.text_codec import BYTES, IncrementalDetokenizer
from raylane.serving.generation.tokenizer_codec import load_codec
from raylane.serving.openai_protocol import ChatCompletionRequest, TextStream
from tests.unit.conftest import CHECKPOINT

# Multi-byte characters the BPE merges into tokens of their own and splits over byte tokens.
CORPUS = [
    "café crème brûlée, déjà vu, élève é é é",
    "漢字 漢字 漢字 かな カナ 한국어 中文 漢",
    "emoji 🙂 🙂 🚀 👩‍💻 🎉🎉 and ascii def main(): return 42",
    "naïve façade — “quotes” … ½ ∑ ∞ € £ ¥",
]
CHATML = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Qu'est-ce que le 漢字? 🙂"},
    {"role": "assistant", "content": "Characters."},
    {"role": "user", "content": "More."},
]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(CORPUS * 4, 400).hf


def _streamed(hf, ids: list[int], prompt: list[int] = ()) -> list[str]:
    detokenizer = IncrementalDetokenizer(hf, list(prompt))
    chunks = [detokenizer.feed(token) for token in ids]
    return [*chunks, detokenizer.flush()]


def test_incremental_text_equals_decoding_all_ids_of_random_streams(bpe):
    rng = random.Random(0)
    ordinary = [i for i in range(bpe.get_vocab_size()) if bpe.id_to_token(i) != END_OF_TEXT]
    multibyte = [i for i in ordinary if len(bpe.decode([i]).encode()) > 1]
    assert len(multibyte) > 10  # merged multi-byte characters are among the tokens
    held = 0
    for _ in range(200):
        ids = [rng.choice(ordinary) for _ in range(rng.randint(1, 40))]
        chunks = _streamed(bpe, ids)
        assert "".join(chunks) == bpe.decode(ids)
        held += chunks[:-1].count("")
    assert held > 50  # characters split over tokens were held back, then released whole


def test_text_split_over_tokens_is_released_only_when_whole(bpe):
    for text in CORPUS:
        ids = bpe.encode(text).ids
        chunks = _streamed(bpe, ids, prompt=bpe.encode("x: ").ids)
        assert "".join(chunks) == text
        assert not any("\ufffd" in chunk for chunk in chunks)
    one = bpe.encode("🚀").ids  # 4 bytes: no merge, so several tokens and one character
    assert len(one) > 1 and _streamed(bpe, one)[: len(one) - 1] == [""] * (len(one) - 1)


def test_the_bytes_codec_is_the_byte_level_models():
    assert BYTES.encode("é!") == [0xC3, 0xA9, 0x21] and BYTES.vocab_size == 256
    detokenizer = BYTES.detokenizer([1, 2])
    assert [detokenizer.feed(t) for t in (0xC3, 0xA9)] == [b"\xc3", b"\xa9"]
    assert BYTES.stop_text("é") == "é".encode() and not BYTES.eos_ids


def _checkpoint_copy(tmp_path, **config):
    """The shipped checkpoint's tokenizer files, its tokenizer_config.json updated by `config`."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(CHECKPOINT / name, tmp_path / name)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return tmp_path


def _hf_render(directory, messages) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_chat_template_renders_as_transformers_does(tmp_path):
    shipped = load_codec(CHECKPOINT)
    assert shipped.eos_ids == {0} and shipped.has_chat_template
    assert shipped.render_chat(MESSAGES) == _hf_render(CHECKPOINT, MESSAGES)
    chatml = _checkpoint_copy(tmp_path, chat_template=CHATML, bos_token=END_OF_TEXT)
    codec = load_codec(chatml)
    rendered = codec.render_chat(MESSAGES)
    assert rendered == _hf_render(chatml, MESSAGES)
    assert rendered.startswith(END_OF_TEXT) and rendered.endswith("<|im_start|>assistant\n")
    ids = codec.chat_prompt(MESSAGES)
    assert ids[0] == 0 and codec.tokenizer.hf.decode(ids, skip_special_tokens=False) == rendered


def test_end_of_sequence_ids_come_from_every_config(tmp_path):
    directory = _checkpoint_copy(tmp_path)
    (directory / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    (directory / "config.json").write_text('{"eos_token_id": 11}')
    assert load_codec(directory).eos_ids == {0, 7, 9, 11}
    (directory / "tokenizer_config.json").write_text("{}")
    plain = load_codec(directory)  # no template: the server renders chats as plain lines
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        plain.render_chat(MESSAGES)


def test_the_server_text_stream_decodes_bytes_and_passes_text():
    stream = TextStream()
    assert [stream.feed(b"\xe6\xbc"), stream.feed(b"\xa2"), stream.feed("字 ")] == ["", "漢", "字 "]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.template_messages() == [{"role": "user", "content": "hi"}]
