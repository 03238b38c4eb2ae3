"""The model families' shapes (`raylane.models.shape`, `raylane.models.families`) against the
real modules: raylane's own Llama, and `transformers`' for published checkpoints' widths."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import transformers
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import raylane
from raylane.config import ModelConfig
from raylane.config.layout import stage_boundaries
from raylane.models.families import FAMILIES, family, family_for_model_type, shape_of
from raylane.models.gpt import GPT
from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.models.llama_plan import block_plan
from raylane.models.shape import DecoderShape
from raylane.parallel.pipeline import build_stage_module

#: Widths of raylane Llamas: grouped-query, tied embeddings, Qwen2's q/k/v biases.
LLAMAS = [
    dict(vocab_size=512, d_model=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=256),
    dict(vocab_size=300, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=192,
         tie_embeddings=True),
    dict(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=128,
         qkv_bias=True, model_type="qwen2"),
]  # fmt: skip
CONTEXT = 40


def _module(widths: dict) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**widths, max_positions=CONTEXT))


def _shape(widths: dict) -> DecoderShape:
    return DecoderShape.llama(
        widths["vocab_size"], CONTEXT, widths["d_model"], widths["n_layers"], widths["n_heads"],
        widths["n_kv_heads"], widths["ffn_dim"], tied_embeddings=widths.get("tie_embeddings",
        False), qkv_bias=widths.get("qkv_bias", False),
    )  # fmt: skip


@pytest.mark.parametrize("widths", LLAMAS)
def test_a_llamas_parameter_count_is_the_modules_own(widths):
    assert _shape(widths).total() == sum(p.numel() for p in _module(widths).parameters())


# Published config.json widths: Llama 3 8B, Qwen2.5-0.5B (tied, q/k/v biases) and Qwen3-0.6B
# (per-head q/k norms, a head_dim wider than hidden_size / heads); with their model cards'
# 8.03 B, 0.49 B and 0.6 B parameters.
PUBLISHED = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
}  # fmt: skip


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_checkpoints_shape_counts_what_transformers_builds(name):
    """The shape read from a config.json counts every parameter `transformers` builds for it
    (on the meta device: no memory)."""
    raw = PUBLISHED[name]
    shape = DecoderShape.from_hf_config(raw, 2048, f"{name}/config.json")
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape.total() == sum(p.numel() for p in model.parameters())
    assert shape.family == raw["model_type"]


def test_llama_3_8b_has_its_published_size():
    shape = DecoderShape.from_hf_config(PUBLISHED["llama3-8b"], 8192, "config.json")
    assert shape.total() == 8_030_261_248
    # bf16 keys and values of its 8 key/value heads: 128 KiB per token.
    assert shape.kv_cache_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072


@pytest.mark.parametrize("widths", LLAMAS[:2])
def test_a_llamas_tensor_parallel_share_follows_its_plan(widths):
    """What a tp=2 device holds, counted from `llama_plan`'s styles on the real module."""
    model, tp, plan = _module(widths), 2, block_plan()
    held = 0.0
    for name, param in model.named_parameters():
        module_name, kind = name.rsplit(".", 1)
        style = next((s for key, s in plan.items() if module_name.endswith(f".{key}")), None)
        split = style is not None and (kind == "weight" or isinstance(style, ColwiseParallel))
        held += param.numel() / tp if split else param.numel()
    assert _shape(widths).params_per_device(tp=tp) == pytest.approx(held)


@pytest.mark.parametrize("widths", LLAMAS[:2])
def test_a_llamas_pipeline_stages_hold_what_the_shape_says(widths):
    """Untied: embedding on the first stage, norm and head on the last; tied: the last stage
    holds its own copy of the matrix."""
    model = _module(widths)
    bounds = stage_boundaries(widths["n_layers"], 2, None)
    for stage in range(2):
        module = build_stage_module(copy.deepcopy(model), stage, bounds)
        held = sum(p.numel() for p in module.parameters())
        assert _shape(widths).params_per_device(pp=2, stage=stage) == held


@pytest.mark.parametrize("widths", LLAMAS)
def test_forward_flops_are_what_torch_counts(widths):
    """Every matmul and the attention core (counted as torch's math kernel computes it: the
    whole T x T, Megatron's convention) of a forward at T tokens: exactly."""
    model, rows, tokens = _module(widths), 3, 32
    x = torch.randint(0, widths["vocab_size"], (rows, tokens))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x)
    blocks, head = _shape(widths).forward_flops_per_token(tokens)
    assert counter.get_total_flops() == (blocks + head) * rows * tokens


@pytest.mark.parametrize("widths", LLAMAS)
def test_activation_bytes_are_what_autograd_saves(widths):
    """What one block saves for backward, fp32 (twice the 16-bit count), beside the fused
    kernel's log-sum-exp: to within 1 % (the norms' per-token fp32 scales and the rotary
    angles are not counted)."""
    model, rows = _module(widths), 3
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, tensor)  # held, so no two live tensors share an address
        return tensor

    x = torch.randn(rows, CONTEXT, widths["d_model"], requires_grad=True)
    cos, sin = model.rotary(torch.arange(CONTEXT))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.blocks["0"](x, cos, sin)
    measured = sum(t.untyped_storage().nbytes() for t in saved.values()) / (rows * CONTEXT)
    split, whole = _shape(widths).activation_bytes_per_token()
    predicted = 2 * (split + whole) + 4 * widths["n_heads"]
    assert measured == pytest.approx(predicted, rel=0.01)
    assert measured > predicted  # what is not counted only adds


def test_the_planner_reads_every_language_family_from_its_config():
    gpt = ModelConfig(kind="gpt", num_classes=256, input_dim=128, d_model=64, n_heads=4,
                      n_layers=2)  # fmt: skip
    llama = ModelConfig(kind="llama", num_classes=512, input_dim=CONTEXT, d_model=96,
                        n_heads=6, n_kv_heads=2, ffn_dim=256, n_layers=2)  # fmt: skip
    assert shape_of(gpt).total() == sum(p.numel() for p in GPT(256, 128, 64, 4, 2).parameters())
    assert shape_of(llama) == _shape(LLAMAS[0])
    assert set(FAMILIES) == {"gpt", "llama", "mlp", "cnn", "custom"}


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("mlp", "model.kind 'mlp' is a classifier: `raylane plan` plans language models"),
        ("custom", "model.kind 'custom': no formula knows a custom module's FLOPs"),
    ],
)
def test_a_family_without_a_shape_says_why(kind, message):
    with pytest.raises(ValueError, match=message):
        family(kind).shape_of(ModelConfig())


def test_an_unknown_family_or_checkpoint_is_named_in_one_line():
    with pytest.raises(ValueError, match=r"model.kind 'rnn' is not a model family \(gpt, "):
        family("rnn")
    with pytest.raises(ValueError, match=r"ckpt/config.json: model_type 'gemma2' is not a fam"):
        family_for_model_type("gemma2", "ckpt/config.json")
    with pytest.raises(ValueError, match=r"ckpt/config.json: model_type 'gemma2' is not a fam"):
        DecoderShape.from_hf_config({"model_type": "gemma2"}, 64, "ckpt/config.json")
    missing = {k: v for k, v in PUBLISHED["llama3-8b"].items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match=r"^c/config.json: intermediate_size is missing$"):
        DecoderShape.from_hf_config(missing, 64, "c/config.json")
    assert family_for_model_type("qwen2", "c/config.json").kind == "llama"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kind="gpt", n_kv_heads=2), "model.n_kv_heads is read by kind 'llama', not 'gpt'"),
        (dict(kind="mlp", d_model=128), "model.d_model is read by kinds 'gpt' and 'llama', not "
         "'mlp'"),
        (dict(kind="llama", hidden_sizes=[32]), "model.hidden_sizes is read by kinds 'mlp' and "
         "'cnn', not 'llama'"),
        (dict(kind="gpt", factory="m:f"), "model.factory is read by kind 'custom', not 'gpt'"),
        (dict(kind="cnn", input_dim=64, pretrained="ckpt"), "model.pretrained is read by kind "
         "'llama', not 'cnn'"),
    ],
)  # fmt: skip
def test_a_field_of_another_family_is_named_in_one_line(fields, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        ModelConfig(**fields)


def test_a_resolved_config_with_every_field_listed_validates_again():
    """A run's logged config lists every field at its value, defaults included."""
    for model in (ModelConfig(kind="gpt", d_model=32), ModelConfig(kind="mlp")):
        assert ModelConfig.model_validate(model.model_dump()) == model


def test_the_trait_table_and_the_registry_name_the_same_families():
    """The config's traits (torch-free) and the models' registry are one list of families."""
    from typing import get_args

    from raylane.config.families import TRAITS

    assert set(TRAITS) == set(FAMILIES)
    assert list(get_args(ModelConfig.model_fields["kind"].annotation)) == list(TRAITS)


#: A comparison of a model kind (or a checkpoint's model_type) with a family's name.
_NAMES = "gpt|llama|mlp|cnn|custom|qwen2|qwen3|mistral"
_KIND_BRANCH = re.compile(
    rf"""(kind|model_type)\s*(==|!=|\bin\b|\bnot in\b)\s*\(?\s*["']({_NAMES})["']"""
    r"""|isinstance\([^)]*(GPT|LlamaForCausalLM)\b"""
)


def test_nothing_outside_the_families_branches_on_one():
    """The trainer, data, tracking, serving and the config ask a family's traits or its module
    (`raylane.config.families`, the decoding interface): no code outside `raylane/models/`
    compares a kind with a family's name."""
    package = Path(raylane.__file__).parent
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if "models" not in path.relative_to(package).parts[:1]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _KIND_BRANCH.search(line)
    ]
    assert found == []
