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
