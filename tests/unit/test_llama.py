"""raylane's Llama-family decoder against transformers' own, on tiny random checkpoints written
by `save_pretrained`: logits, greedy decoding through the KV cache, export, sharded weights,
and the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from raylane.config import ModelConfig, RaylaneConfig
from raylane.models import build_model
from raylane.models.hf_checkpoint import load_pretrained, read_config, save_pretrained
from raylane.models.llama import LlamaForCausalLM, llama_config

VOCAB = 320
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
    initializer_range=0.2,  # spread-out logits: greedy picks are no near-ties
)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
#: raylane's modules run the same operations in the same order as transformers' on the same
#: weights (fp32, CPU): the logits measured equal (0.0 for every family); 1e-6 leaves room only
#: for a CPU whose kernels round differently.
TOLERANCE = 1e-6


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":  # q/k/v biases and a tied head
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(tie_word_embeddings=True, **SHAPE)
        )
        with torch.no_grad():  # Qwen2 initialises its biases to zero: make them count
            for block in model.model.layers:
                for proj in (
                    block.self_attn.q_proj,
                    block.self_attn.k_proj,
                    block.self_attn.v_proj,
                ):
                    proj.bias.normal_(std=0.5)
        return model.eval()
    if kind == "qwen3":  # per-head q/k norms, a head_dim wider than hidden_size / heads
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **SHAPE))
        with torch.no_grad():  # the norms start at one: make them count
            for block in model.model.layers:
                block.self_attn.q_norm.weight.normal_(1.0, 0.5)
                block.self_attn.k_norm.weight.normal_(1.0, 0.5)
        return model.eval()
    if kind == "mistral":  # no sliding window: raylane attends over the whole context
        config = transformers.MistralConfig(sliding_window=None, **SHAPE)
        return transformers.MistralForCausalLM(config).eval()
    rope = {"rope_parameters": LLAMA3_ROPE} if kind == "llama3" else {}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **rope)).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3", "qwen3", "mistral"])
def checkpoint(request, tmp_path_factory):
    """(transformers' model, the directory it saved itself to)."""
    torch.set_num_threads(2)
    model = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 2048}\n')
    return model, directory


def _tokens(batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def _max_diff(hf_model, model: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (hf_model(tokens).logits - model(tokens)).abs().max().item()


def test_logits_equal_transformers(checkpoint):
    hf_model, directory = checkpoint
    model = load_pretrained(directory).eval()
    diff = _max_diff(hf_model, model, _tokens())
    assert diff <= TOLERANCE, f"max abs logit difference {diff:.3g}"
    assert not any(p.is_meta for p in model.parameters())
    tied = model.head.weight is model.tok_emb.weight
    assert tied == hf_model.config.tie_word_embeddings
    bias = model.blocks["0"].self_attn.q_proj.bias
    assert (bias is not None) == (hf_model.config.model_type == "qwen2")


def test_greedy_decoding_with_and_without_the_cache_equals_generate(checkpoint):
    hf_model, directory = checkpoint
    model = load_pretrained(directory).eval()
    prompts, new = _tokens(length=8), 64
    hf_model.generation_config.eos_token_id = None  # decode all 64 tokens
    with torch.no_grad():
        expected = hf_model.generate(prompts, max_new_tokens=new, do_sample=False, pad_token_id=0)[
            :, prompts.shape[1] :
        ]
        cache, slots = model.kv_cache(slots=2, max_len=8 + new), [0, 1]
        logits = model.extend(prompts, cache, slots)  # prefill both slots, then one step each
        picked = []
        for _ in range(new):
            picked.append(logits[:, -1].argmax(-1))
            logits = model.extend(picked[-1][:, None], cache, slots)
        sequence = prompts  # no cache: every token from a forward over the whole sequence
        for _ in range(new):
            sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1)[:, None]], dim=1)
    assert cache.lengths == [8 + new] * 2
    assert torch.equal(torch.stack(picked, dim=1), expected)
    assert torch.equal(sequence[:, 8:], expected)


def test_export_loads_in_transformers_with_equal_logits(checkpoint, tmp_path):
    hf_model, directory = checkpoint
    model = load_pretrained(directory).eval()
    out = save_pretrained(model, tmp_path / "export", source=directory)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    diff = _max_diff(reloaded, model, _tokens())
    assert diff <= TOLERANCE, f"round trip: max abs logit difference {diff:.3g}"
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (directory / name).read_bytes()
    written, source = (json.loads((d / "config.json").read_text()) for d in (out, directory))
    assert written["eos_token_id"] == source["eos_token_id"]


def test_sharded_checkpoint_loads(checkpoint, tmp_path):
    hf_model, _ = checkpoint
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    diff = _max_diff(hf_model, load_pretrained(tmp_path).eval(), _tokens())
    assert diff <= TOLERANCE, f"sharded: max abs logit difference {diff:.3g}"


@pytest.fixture
def llama_dir(tmp_path):
    _hf_model("llama").save_pretrained(tmp_path)
    return tmp_path


def _edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _one_line_error(directory) -> str:
    with pytest.raises(ValueError) as error:
        load_pretrained(directory)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_missing_and_misshapen_tensors_are_named(llama_dir):
    weights = llama_dir / "model.safetensors"
    state = load_file(weights)
    key = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != key}, weights, metadata={"format": "pt"})
    assert _one_line_error(llama_dir) == f"{weights}: tensor '{key}' is missing"
    state[key] = state[key][:, :32].contiguous()
    save_file(state, weights, metadata={"format": "pt"})
    message = _one_line_error(llama_dir)
    assert message.startswith(f"{weights}: tensor '{key}' has shape (128, 32)"), message
    state[key] = state[key].repeat(1, 2)
    save_file(state | {"model.layers.2.mlp.up_proj.weight": state[key].clone()}, weights,
              metadata={"format": "pt"})  # fmt: skip
    assert "unexpected tensor 'model.layers.2.mlp.up_proj.weight'" in _one_line_error(llama_dir)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"model_type": "mistral", "sliding_window": 512}, "sliding_window 512 is shorter"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(llama_dir, changes, expected):
    _edit_config(llama_dir, **changes)
    message = _one_line_error(llama_dir)
    assert message.startswith(f"{llama_dir / 'config.json'}: ") and expected in message, message


def test_mistral_without_a_window_and_legacy_rope_fields_are_read(llama_dir):
    _edit_config(llama_dir, model_type="mistral", sliding_window=None, rope_parameters=None,
                 rope_theta=250000.0, rope_scaling=None)  # fmt: skip
    cfg = read_config(llama_dir)
    assert (cfg.model_type, cfg.rope_theta, cfg.rope_scaling) == ("mistral", 250000.0, None)


def test_model_config_checks_the_checkpoint(llama_dir):
    with pytest.raises(ValidationError, match="model.num_classes is 10 but .* has vocab_size 320"):
        ModelConfig(kind="llama", pretrained=llama_dir, num_classes=10)
    with pytest.raises(ValidationError, match="model.input_dim 4096 is longer"):
        ModelConfig(kind="llama", pretrained=llama_dir, num_classes=VOCAB, input_dim=4096)
    with pytest.raises(ValidationError, match="model.pretrained is read by kind 'llama'"):
        ModelConfig(kind="gpt", pretrained=llama_dir)
    cfg = ModelConfig(kind="llama", pretrained=llama_dir, num_classes=VOCAB, input_dim=128)
    model = build_model(cfg)
    reference = load_file(llama_dir / "model.safetensors")
    assert torch.equal(model.blocks["1"].mlp.down_proj.weight,
                       reference["model.layers.1.mlp.down_proj.weight"])  # fmt: skip


def test_random_llama_from_the_config():
    cfg = ModelConfig(kind="llama", num_classes=300, input_dim=48, d_model=64, n_heads=4,
                      n_layers=2, n_kv_heads=2, tie_embeddings=True, qkv_bias=True)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg)
    assert isinstance(model, LlamaForCausalLM)
    assert model.head.weight is model.tok_emb.weight
    assert model.blocks["0"].self_attn.k_proj.out_features == 2 * 16
    assert model.blocks["0"].mlp.gate_proj.out_features == 192  # 8/3 * 64, up to 64s
    assert model(torch.zeros(3, 48, dtype=torch.long)).shape == (3, 48, 300)
    assert llama_config(cfg).model_type == "qwen2"
    with pytest.raises(ValidationError, match=r"n_heads \(4\) must be a multiple of n_kv_heads"):
        ModelConfig(kind="llama", n_heads=4, n_kv_heads=3)


def _run_config(**parallelism) -> RaylaneConfig:
    return RaylaneConfig.model_validate({
        "experiment": "llama",
        "data": {"source": "parquet"},
        "model": {"kind": "llama", "num_classes": 256, "input_dim": 32},
        "parallelism": parallelism,
    })  # fmt: skip


def test_llama_layouts_and_those_refused():
    assert _run_config(strategy="fsdp", workers=2).model.kind == "llama"
    refused = "model.kind 'llama' trains with strategy 'ddp', 'fsdp', 'tp', 'pipeline' or"
    with pytest.raises(ValidationError, match=refused):
        _run_config(strategy="local_sgd", workers=2)
    # Pipeline stages and context parallelism (proven in test_llama_pp_cp.py).
    assert _run_config(
        strategy="pipeline", pp=2, workers=2, microbatches=2
    ).parallelism.dims.pp_enabled
    assert _run_config(strategy="ddp", cp=2, workers=2).parallelism.dims.cp_enabled
    # Its tensor-parallel plan inside context-parallel groups and pipeline stages (proven in
    # test_layout_equivalence.py).
    assert _run_config(strategy="tp", tp=2, cp=2, workers=4).parallelism.dims.cp_enabled
    assert _run_config(
        strategy="pipeline", pp=2, tp=2, workers=4, microbatches=2
    ).parallelism.dims.tp_enabled
    with pytest.raises(ValidationError, match="without sequence_parallel and without sharded"):
        _run_config(strategy="tp", tp=2, cp=2, workers=4, sequence_parallel=True)
    tied = {"kind": "llama", "num_classes": 256, "input_dim": 32, "tie_embeddings": True}
    with pytest.raises(ValidationError, match="a llama whose head is its embedding"):
        RaylaneConfig.model_validate({
            "experiment": "llama", "data": {"source": "parquet"}, "model": tied,
            "parallelism": {"strategy": "pipeline", "pp": 2, "workers": 2, "microbatches": 2},
        })  # fmt: skip


def test_tensor_parallel_llama_layouts_need_whole_heads_and_equal_mlp_parts():
    assert _run_config(strategy="tp", tp=2, workers=2).parallelism.tp == 2
    fsdp_tp = _run_config(strategy="fsdp", tp=2, workers=4, sequence_parallel=True)
    assert fsdp_tp.parallelism.dims.tp_enabled and fsdp_tp.parallelism.dims.fsdp_enabled
    model = {"kind": "llama", "num_classes": 256, "input_dim": 32}
    for shape, field in (
        ({"n_heads": 2, "d_model": 64}, "n_heads (2)"),
        ({"n_kv_heads": 2}, "n_kv_heads (2)"),
        ({"ffn_dim": 102}, "ffn_dim (102)"),
    ):
        with pytest.raises(ValidationError) as error:
            RaylaneConfig.model_validate({
                "experiment": "llama", "data": {"source": "parquet"},
                "model": model | shape, "parallelism": {"strategy": "tp", "tp": 4, "workers": 4},
            })  # fmt: skip
        message = str(error.value.errors()[0]["msg"])
        assert f"model.{field} is not divisible by parallelism.tp (4)" in message, message
        assert "\n" not in message
    with pytest.raises(ValidationError, match="model.tie_embeddings"):
        RaylaneConfig.model_validate({
            "experiment": "llama", "data": {"source": "parquet"},
            "model": model | {"tie_embeddings": True},
            "parallelism": {"strategy": "tp", "tp": 2, "workers": 2, "sequence_parallel": True},
        })  # fmt: skip
