"""A Llama-family model served with its own tokenizer: greedy decoding through the engine (KV
cache, continuous batching) against `transformers`' `generate`, stop strings and end-of-sequence
ids on decoded text, and a registered version loaded for generation."""

from __future__ import annotations

import shutil

import mlflow
import pytest
import torch
import transformers

from raylane.models.hf_checkpoint import load_pretrained
from raylane.models.llama import LlamaForCausalLM
from raylane.serving.generation.engine import GenerationEngine
from raylane.serving.generation.loader import load_generation_model
from raylane.serving.generation.sampling import SamplingParams
from raylane.serving.generation.tokenizer_codec import TokenizerCodec, load_codec
from raylane.tracking.checkpoints_hf import import_checkpoint
from tests.unit.conftest import CHECKPOINT

NEW = 64
PROMPTS = ["def main(", "import os\nclass Path:", "é 漢字 🙂 return"]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama with the shipped checkpoint's tokenizer, its logits spread out so greedy
    picks are no near-ties: (transformers' model, its directory)."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(CHECKPOINT / name, directory / name)
    return model, directory


@pytest.fixture(scope="module")
def served(checkpoint):
    _, directory = checkpoint
    return load_pretrained(directory).eval(), load_codec(directory)


def _run(engine: GenerationEngine, requests) -> list:
    """Queue every `(ids, params)` at once and step until all end; each sequence and the text
    streamed for it."""
    sequences = [engine.add(ids, params) for ids, params in requests]
    streamed = {s.id: "" for s in sequences}
    while engine.busy:
        for event in engine.step():
            streamed[event.sequence.id] += event.text
    return [(s, streamed[s.id]) for s in sequences]


def test_greedy_batched_decoding_equals_transformers_generate(checkpoint, served):
    hf_model, _ = checkpoint
    model, codec = served
    no_eos = TokenizerCodec(codec.tokenizer, frozenset(), codec.chat)  # all NEW tokens
    engine = GenerationEngine(model, max_num_seqs=2, codec=no_eos)  # 3 requests, 2 slots
    prompts = [codec.encode(text) for text in PROMPTS]
    done = _run(engine, [(ids, GREEDY) for ids in prompts])
    for ids, (sequence, streamed) in zip(prompts, done, strict=True):
        expected = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()  # fmt: skip
        assert sequence.output == expected  # token for token, NEW of them
        assert streamed == codec.tokenizer.hf.decode(expected, skip_special_tokens=True)
    assert engine.tokens_generated == 3 * NEW


def test_a_stop_string_on_decoded_text_ends_the_output_before_it(served):
    model, codec = served
    engine = GenerationEngine(model, max_num_seqs=3, codec=codec)
    prompt = codec.encode(PROMPTS[0])
    full = engine.generate(prompt, GREEDY.model_copy(update={"max_tokens": 24}))
    text = full.text()
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    [(sequence, streamed)] = _run(engine, [(prompt, GREEDY.model_copy(update={"stop": [stop]}))])
    assert sequence.finish_reason == "stop" and sequence.text() == text[:cut] == streamed
    assert sequence.output == full.output[: len(sequence.output)]  # tokens, not characters
    assert len(codec.tokenizer.hf.decode(sequence.output)) >= cut + 1


def test_an_end_of_sequence_id_stops_the_output_and_is_not_text(served):
    model, codec = served
    prompt = codec.encode(PROMPTS[1])
    plain = GenerationEngine(model, 1, codec=codec).generate(prompt, GREEDY).output
    end = plain[5]
    ends = TokenizerCodec(codec.tokenizer, frozenset({end}), codec.chat)
    [(sequence, streamed)] = _run(GenerationEngine(model, 1, codec=ends), [(prompt, GREEDY)])
    at = plain.index(end)
    assert sequence.finish_reason == "stop" and sequence.output == plain[: at + 1]
    assert streamed == sequence.text() == codec.tokenizer.hf.decode(plain[:at])


def test_prompt_limits_are_in_tokens(served):
    model, codec = served
    engine = GenerationEngine(model, 1, codec=codec, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(5\) exceeds"):
        engine.add([1] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="prompt token ids lie in 0-511"):
        engine.add([512], SamplingParams(max_tokens=5))


def test_an_imported_checkpoint_loads_for_generation_with_its_tokenizer(tmp_path, checkpoint):
    hf_model, directory = checkpoint
    before = mlflow.get_tracking_uri()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    try:
        imported = import_checkpoint(directory, "tiny", store)
        served = load_generation_model(store, "tiny", imported.version)
    finally:
        mlflow.set_tracking_uri(before)
    assert isinstance(served.model, LlamaForCausalLM) and served.card.context == 256
    codec = served.card.codec
    assert codec.eos_ids == {0} and codec.has_chat_template
    ids = codec.encode(PROMPTS[2])
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits
        assert torch.allclose(served.model(torch.tensor([ids])), expected, atol=1e-4)
