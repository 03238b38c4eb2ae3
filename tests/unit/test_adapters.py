"""LoRA adapters on raylane's GPT (PEFT injected into the plain model): exact at the start,
only the adapters train, merging changes nothing but the layers, and bad settings are named."""

from __future__ import annotations

import re

import pytest
import torch

from raylane.config import ConfigError, load_config
from raylane.config.finetune import FinetuneConfig
from raylane.models.adapters import (
    AdapterTargetError,
    adapter_state,
    apply_lora,
    load_adapter,
    merge_adapters,
    trainable_fraction,
)
from raylane.models.gpt import GPT
from tests.readme_blocks import ROOT

LORA = ROOT / "configs" / "finetune" / "lm_lora.yaml"


def _base() -> GPT:
    torch.manual_seed(0)
    return GPT(256, 32, 32, 2, 2).eval()


def _lora(**fields) -> FinetuneConfig:
    return FinetuneConfig(base="models:/base/1", **{"rank": 4, **fields})


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))


def test_zero_initialised_adapters_reproduce_the_base_exactly_and_only_they_train():
    base, adapted = _base(), apply_lora(_base(), _lora(target_modules=["q", "v"]))
    x = _tokens()
    assert torch.equal(adapted(x), base(x))
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert {n.split(".lora_")[0] for n in trainable} == {
        f"blocks.{i}.attn.{m}" for i in range(2) for m in ("q", "v")
    }
    assert 0 < trainable_fraction(adapted) < 0.05

    before = {n: p.detach().clone() for n, p in adapted.named_parameters()}
    optimizer = torch.optim.SGD([p for p in adapted.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):  # the first step moves B only (A's gradient is zero while B is)
        optimizer.zero_grad()
        adapted(x).logsumexp(-1).mean().backward()
        optimizer.step()
    changed = {n for n, p in adapted.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable
    assert not torch.allclose(adapted(x), base(x))


def test_merging_folds_the_adapter_into_plain_weights_and_an_adapter_reloads_exactly():
    adapted = apply_lora(_base(), _lora())
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    x = _tokens()
    expected, state = adapted(x), adapter_state(adapted)
    assert state and all(".lora_" in name for name in state)

    reloaded = load_adapter(apply_lora(_base(), _lora()), state)
    assert torch.equal(reloaded(x), expected)
    merged = merge_adapters(reloaded)
    assert set(merged.state_dict()) == set(_base().state_dict())  # the plain model's names
    torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="the adapter does not fit this model: 12 tensors"):
        load_adapter(apply_lora(_base(), _lora(target_modules=["q"])), state)


def test_target_modules_that_match_nothing_are_named_with_the_models_linears():
    with pytest.raises(AdapterTargetError, match=re.escape(
        "finetune.target_modules ['qkv'] match no linear layer of the model; its linears are "
        "attn.k, attn.proj, attn.q, attn.v, head, mlp.0, mlp.2"
    )):  # fmt: skip
        apply_lora(_base(), _lora(target_modules=["q", "qkv"]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["finetune.base=raylane-lm-serve"], "is not models:/NAME/VERSION or models:/NAME@ALIAS"),
        (["parallelism.strategy=tp", "parallelism.tp=2"],
         "finetune runs on strategy 'ddp' or 'fsdp' with every worker holding whole blocks "
         "(got 'tp', pp 1, tp 2)"),
        (["parallelism.strategy=fsdp", "parallelism.tp=2"], "(got 'fsdp', pp 1, tp 2)"),
        (["finetune.target_modules=[]"], "finetune.target_modules"),
        (["finetune.method=qlora"], "finetune.method"),
    ],
)  # fmt: skip
def test_a_finetune_config_mistake_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(LORA, overrides)


def test_the_reference_finetune_config_trains_about_two_percent_of_the_base():
    cfg = load_config(LORA)
    from raylane.models import build_model

    fraction = trainable_fraction(apply_lora(build_model(cfg.model), cfg.finetune))
    assert 0.01 < fraction <= 0.02, fraction


def _trained_adapter(seed: int, **fields) -> tuple[dict, FinetuneConfig]:
    """An adapter with non-zero updates (random B, as after training) and its settings."""
    lora = _lora(**fields)
    adapted = apply_lora(_base(), lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return adapter_state(adapted), lora


def _merged(state: dict, lora: FinetuneConfig) -> GPT:
    return merge_adapters(load_adapter(apply_lora(_base(), lora), state)).eval()


def test_one_base_serves_several_adapters_in_one_batch_as_their_merged_models():
    from raylane.models.multi_lora import AdapterCapacityError
    from raylane.serving.generation.engine import GenerationEngine, generate_without_cache
    from raylane.serving.generation.sampling import SamplingParams

    first = _trained_adapter(1, target_modules=["q", "v"])
    second = _trained_adapter(2, rank=8, alpha=8.0, target_modules=["k", "proj", "mlp.0"])
    engine = GenerationEngine(_base(), max_num_seqs=4, max_adapters=2)
    rows = [engine.adapters.add(key, state, lora.alpha / lora.rank)
            for key, (state, lora) in (("a/1", first), ("b/1", second))]  # fmt: skip
    assert rows == [1, 2]

    # One forward over rows of no adapter, the first, the second: each row as its own model.
    x = _tokens()
    engine.adapters.select([0, 1, 2])
    with torch.no_grad():
        mixed = engine.model(x)
        for i, model in enumerate([_base(), _merged(*first), _merged(*second)]):
            torch.testing.assert_close(mixed[i], model(x[i : i + 1])[0], rtol=1e-5, atol=1e-5)
    engine.adapters.select([0, 0, 0])
    assert engine.adapters.selection.rows is None

    # Greedy decoding of all three together under continuous batching, KV cache included.
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = list(b"def f(x):")
    rows = [0, engine.adapters.acquire("a/1"), engine.adapters.acquire("b/1")]
    sequences = [engine.add(prompt, params, row) for row in rows]
    while engine.busy:
        engine.step()
    expected = [generate_without_cache(m, prompt, params).output
                for m in (_base(), _merged(*first), _merged(*second))]  # fmt: skip
    assert [s.output for s in sequences] == expected
    assert len({tuple(o) for o in expected}) == 3  # the adapters really differ here
    assert engine.adapters.users == {1: 0, 2: 0}

    # A third adapter takes the least recently used idle row; with both rows in use, none.
    engine.adapters.release(engine.adapters.acquire("b/1"))
    assert engine.adapters.add("c/1", *_scaled(_trained_adapter(3))) == 1
    assert "a/1" not in engine.adapters
    for key in ("b/1", "c/1"):
        engine.adapters.acquire(key)
    with pytest.raises(AdapterCapacityError, match="all 2 adapter slots hold adapters in use"):
        engine.adapters.add("d/1", *_scaled(_trained_adapter(4)))


def _scaled(adapter: tuple[dict, FinetuneConfig]) -> tuple[dict, float]:
    state, lora = adapter
    return state, lora.alpha / lora.rank


def test_an_adapter_that_does_not_fit_the_served_model_is_named():
    from raylane.models.multi_lora import AdapterSet

    adapters = AdapterSet(_base(), 2)
    state, _ = _trained_adapter(1)
    renamed = {k.replace("attn.q", "attn.qkv"): v for k, v in state.items()}
    with pytest.raises(ValueError, match="names 'blocks.0.attn.qkv', not a linear layer"):
        adapters.add("x/1", renamed, 2.0)
    with pytest.raises(ValueError, match="which is not a LoRA weight"):
        adapters.add("x/1", {"blocks.0.attn.q.weight": torch.zeros(1)}, 2.0)
