"""A LoRA run's frozen base held in bf16 (`finetune.base_dtype`, `raylane.models.frozen`): half
the base's bytes, the same loss and adapter gradients as the fp32 base when the base's values
are bf16's (a bf16 checkpoint: exactly), no fp32 copy of a weight kept for the backward, and
the choice made and refused as the config says."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers

from raylane.config import ConfigError, load_config
from raylane.config.finetune import FinetuneConfig
from raylane.models.adapters import apply_lora
from raylane.models.frozen import FrozenEmbedding, FrozenLinear, hold_frozen
from raylane.models.gpt import GPT
from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.train.loop import _plain_model
from tests.readme_blocks import ROOT

LLAMA_LORA = ROOT / "configs" / "finetune" / "llama_lora.yaml"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, d_model=96, n_layers=2, n_heads=6, n_kv_heads=2,
                         ffn_dim=256, max_positions=64, tie_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(256, 32, 32, 2, 2)


def _adapted(model, targets):
    """`model` with its base rounded to bf16's values and seeded non-zero adapters."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.bfloat16().float())
    apply_lora(model, FinetuneConfig(base="models:/b/1", rank=4, target_modules=targets))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02, generator=torch.Generator().manual_seed(3))
    return model


def _saved_bytes(model, x, y) -> tuple[torch.Tensor, int]:
    """The loss, and the bytes autograd saves for the backward that are not parameters."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in params:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x, targets=y)
    return loss, sum(saved)


@pytest.mark.parametrize(
    ("build", "targets", "vocab"),
    [(_llama, TARGETS, 512), (_gpt, ["q", "k", "v", "proj"], 256)],
    ids=["llama-tied", "gpt"],
)
def test_a_bf16_base_trains_the_adapters_exactly_as_the_fp32_base(build, targets, vocab):
    whole = _adapted(build(), targets)
    held = copy.deepcopy(whole)
    base_bytes = sum(p.numel() * 4 for n, p in whole.named_parameters() if not p.requires_grad)
    held_bytes = hold_frozen(held, torch.bfloat16, torch.float32)
    x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))

    (loss, saved), (held_loss, held_saved) = _saved_bytes(whole, x, y), _saved_bytes(held, x, y)
    loss.backward()
    held_loss.backward()
    assert held_loss.item() == loss.item()
    grads = {n: p.grad for n, p in whole.named_parameters() if p.requires_grad}
    for name, parameter in held.named_parameters():
        narrow = not parameter.requires_grad and "norm" not in name and "ln" not in name
        assert parameter.dtype == (torch.bfloat16 if narrow else torch.float32), name
        if parameter.requires_grad:
            torch.testing.assert_close(parameter.grad, grads[name], rtol=0, atol=1e-7)
    # No fp32 copy of a weight is kept for the backward: what autograd saves is the same.
    assert held_saved == saved
    # The linears and embeddings, about all of the base, in half the bytes.
    assert 0.45 * base_bytes < held_bytes <= 0.5 * base_bytes
    held_types = {type(m) for m in held.modules()}
    assert FrozenLinear in held_types and FrozenEmbedding in held_types
    # The head and loss in chunks of 5 tokens: the bf16 head cast once, the same loss.
    chunk = 5 * 4 * vocab
    for model in (whole, held):
        model.zero_grad()
    chunked = [m(x, targets=y, chunk_bytes=chunk) for m in (whole, held)]
    assert chunked[1].item() == chunked[0].item()
    torch.testing.assert_close(chunked[0], loss, rtol=0, atol=1e-6)
    for loss_of in chunked:
        loss_of.backward()
    for (name, a), (_, b) in zip(whole.named_parameters(), held.named_parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-7, msg=name)


def _bf16_checkpoint(directory) -> None:
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def test_a_bf16_checkpoint_is_read_straight_into_a_bf16_base_under_ddp(tmp_path):
    _bf16_checkpoint(tmp_path)
    spec = SimpleNamespace(base_state=None)
    models = {}
    for base_dtype, strategy in (("auto", "ddp"), ("auto", "fsdp"), ("fp32", "ddp")):
        cfg = load_config(LLAMA_LORA, [f"model.pretrained={tmp_path}",
                                       f"finetune.base_dtype={base_dtype}",
                                       f"parallelism.strategy={strategy}"])  # fmt: skip
        torch.manual_seed(0)  # as every worker seeds before it builds the model
        models[base_dtype, strategy] = _plain_model(cfg, spec)[0]
    held, fsdp, fp32 = models.values()
    frozen = {n: p.dtype for n, p in held.named_parameters() if not p.requires_grad}
    assert frozen["blocks.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert frozen["tok_emb.weight"] == torch.bfloat16
    assert frozen["blocks.0.input_layernorm.weight"] == torch.float32
    assert {p.dtype for p in held.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in fsdp.parameters()} == {p.dtype for p in fp32.parameters()}
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    # The adapters' random start is the fp32 run's: made in fp32, never rounded to bf16.
    adapters = [{n: p for n, p in m.named_parameters() if p.requires_grad} for m in (held, fp32)]
    assert adapters[0].keys() == adapters[1].keys()
    for name, value in adapters[0].items():
        assert torch.equal(value, adapters[1][name]), name
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the checkpoint's values, read as bf16 or as fp32: one model
        assert held(x, targets=x).item() == fp32(x, targets=x).item()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["finetune.method=full", "finetune.base_dtype=bf16"],
         "finetune.base_dtype holds a LoRA run's frozen base; method 'full'"),
        (["parallelism.strategy=fsdp", "finetune.base_dtype=bf16"],
         "finetune.base_dtype 'bf16' with a sharded layout (fsdp)"),
    ],
)  # fmt: skip
def test_a_base_dtype_that_cannot_hold_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(LLAMA_LORA, overrides)
