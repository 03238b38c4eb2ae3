"""Speculative decoding of a Llama-family checkpoint with a smaller draft checkpoint of the same
tokenizer, both Hugging Face directories read as a replica reads an imported version (its
model and draft through `load_pretrained`, each codec through `load_codec`: what
`raylane.serving.generation.loader` does with the directory `raylane export` writes for a `raylane
import`); a draft of another tokenizer is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from raylane.models.hf_checkpoint import load_pretrained, save_pretrained
from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.serving.generation.engine import GenerationEngine
from raylane.serving.generation.sampling import SamplingParams
from raylane.serving.generation.text_codec import BYTES
from raylane.serving.generation.tokenizer_codec import TokenizerCodec, load_codec
from tests.unit.conftest import CHECKPOINT

NEW = 32
PROMPTS = ["def main(", "import os\nclass Path:"]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0)


def _llama(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=512, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                         ffn_dim=128, max_positions=256)  # fmt: skip
    return LlamaForCausalLM(config)


def _write(model: LlamaForCausalLM, directory, tokenizer_dir=CHECKPOINT):
    save_pretrained(model, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """((model, codec) of the target, of the draft): a 3-layer Llama, its logits spread out so
    greedy picks are no near-ties, and as draft its first layer alone (embeddings, norm and
    head shared: an imperfect, cheaper guess), both written with the shipped checkpoint's
    tokenizer and read back."""
    torch.manual_seed(0)
    target = _llama(3)
    with torch.no_grad():
        for parameter in target.parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.2)
    draft = _llama(1)
    draft.load_state_dict(target.state_dict(), strict=False)  # layers 1-2 left out
    root = tmp_path_factory.mktemp("speculative")
    read = []
    for name, model in (("target", target), ("draft", draft)):
        directory = _write(model, root / name)
        read.append((load_pretrained(directory).eval(), load_codec(directory)))
    return read


def _decode(model, codec, prompts, **speculation) -> tuple[list[list[int]], GenerationEngine]:
    no_eos = TokenizerCodec(codec.tokenizer, frozenset(), codec.chat)  # all NEW tokens
    engine = GenerationEngine(model, 2, codec=no_eos, **speculation)
    sequences = [engine.add(codec.encode(text), GREEDY) for text in prompts]
    while engine.busy:
        engine.step()
    return [s.output for s in sequences], engine


def test_a_draft_checkpoint_keeps_greedy_output_and_some_proposals_are_rejected(checkpoints):
    (model, codec), (draft, draft_codec) = checkpoints
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in model.parameters())
    plain, alone = _decode(model, codec, PROMPTS)
    drafted, engine = _decode(model, codec, PROMPTS, speculate=3, draft=draft,
                              draft_codec=draft_codec)  # fmt: skip
    assert drafted == plain and all(len(out) == NEW for out in plain)
    # Both the accepted run and the rejection path ran: the draft is right, but not always.
    assert 0 < engine.accepted < engine.proposed, (engine.accepted, engine.proposed)
    # 8 of 60 proposals accepted here: fewer forwards of the model than decoding alone.
    assert engine.forwards < alone.forwards, (engine.forwards, alone.forwards)


def test_a_draft_of_another_tokenizer_or_of_bytes_is_refused_in_one_line(checkpoints, tmp_path):
    (model, codec), (draft, _) = checkpoints
    spec = json.loads((CHECKPOINT / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]  # two ordinary tokens swap ids
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copyfile(CHECKPOINT / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    other = load_codec(tmp_path)
    assert other.vocab_size == codec.vocab_size  # the same size, not the same ids
    expected = (
        rf"^the draft's tokenizer is not the model's \(token '{first}': id {vocab[second]} in "
        rf"the model's, {vocab[first]} in the draft's\)$"
    )
    with pytest.raises(ValueError, match=expected):
        GenerationEngine(model, 1, 3, draft, codec=codec, draft_codec=other)
    with pytest.raises(ValueError, match="^the draft reads bytes, the model a tokenizer's ids"):
        GenerationEngine(model, 1, 3, draft, codec=codec, draft_codec=BYTES)
