"""A worker's predicted peak memory (`raylane.models.worker_memory`): the LoRA parameter count
is the adapted module's own, each default moves the part it should by what it should, and the
prediction is made where it applies and nowhere else."""

from __future__ import annotations

import pytest

from raylane.config import load_config
from raylane.config.finetune import FinetuneConfig
from raylane.models.adapters import apply_lora
from raylane.models.gpt import GPT
from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.models.shape import DecoderShape
from raylane.models.worker_memory import predict_worker_peak, predicted_peak
from tests.readme_blocks import ROOT

LLAMA = dict(vocab_size=512, d_model=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=256)
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Qwen2.5-0.5B's widths at 256 tokens a sequence.
QWEN = DecoderShape.llama(151936, 256, 896, 24, 14, 2, 4864, tied_embeddings=True, qkv_bias=True)


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", [LLAMA_TARGETS, ["q_proj", "v_proj"], ["mlp.down_proj"]])
def test_the_lora_count_is_what_peft_adds_to_a_llama(targets):
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, max_positions=32))
    apply_lora(model, FinetuneConfig(base="models:/b/1", rank=4, target_modules=targets))
    shape = DecoderShape.llama(512, 32, 96, 2, 6, 2, 256)
    assert shape.lora_params(targets, 4) == _trainable(model)


def test_the_lora_count_is_what_peft_adds_to_a_gpt():
    model = GPT(256, 32, 64, 4, 2)  # 4 heads, 2 blocks
    targets = ["q", "k", "v", "proj", "mlp.0", "mlp.2"]
    apply_lora(model, FinetuneConfig(base="models:/b/1", rank=8, target_modules=targets))
    assert DecoderShape.gpt(256, 32, 64, 2, 4).lora_params(targets, 8) == _trainable(model)


def _peak(**changes):
    settings = dict(
        rows=4,
        trainable=QWEN.lora_params(LLAMA_TARGETS, 8),
        frozen_bytes=2.0,
        recompute=True,
        chunk_bytes=64 * 2**20,
        validation_rows=1,
        runtime=0.0,
    )
    return predict_worker_peak(QWEN, **{**settings, **changes})  # fmt: skip


def test_each_default_moves_its_own_part():
    lean = _peak()
    fp32 = _peak(frozen_bytes=4.0)
    # The frozen base at 2 bytes a parameter instead of 4 (the adapters fp32 in both).
    assert fp32.weights - lean.weights == pytest.approx(
        2 * (QWEN.total() - lean.trainable_state / 12)
    )
    held = _peak(recompute=False)
    # Recomputed: the 24 blocks' activations become their inputs and one block's.
    assert held.activations / lean.activations > 10
    whole = _peak(chunk_bytes=0.0)
    logits = 4 * 256 * 151936 * 4  # 594 MB of fp32 logits a copy
    assert whole.loss == 4 * logits
    assert lean.loss == 3 * 64 * 2**20 + 896 * 151936 * 4  # a chunk, and the bf16 head's copy
    assert fp32.loss == 3 * 64 * 2**20
    # The 0.5B LoRA step of benchmarks/real_size.py (a process that imports peft: ~390 MB)
    # measured 2,419 MB at its peak.
    assert _peak(runtime=390 * 2**20).total / 2**20 == pytest.approx(2419, rel=0.15)


def test_the_prediction_is_made_where_it_applies():
    lora = load_config(ROOT / "configs" / "finetune" / "llama_lora.yaml")
    peak = predicted_peak(lora, validation_rows=10)
    assert peak is not None and peak.total > peak.runtime > 0
    assert predicted_peak(load_config(ROOT / "configs" / "train" / "digits_ddp.yaml"), 10) is None
    split = load_config(ROOT / "configs" / "train" / "lm_tp.yaml")
    assert predicted_peak(split, 10) is None  # the cost model's: a split model


def test_a_local_run_that_cannot_fit_is_refused_with_its_figures():
    from raylane.config import ConfigError
    from raylane.train.preflight import check_fits_here

    held = ["training.activation_checkpointing=false", "training.host_memory=fast"]
    cfg = load_config(ROOT / "configs" / "finetune" / "llama_lora.yaml", held)
    peak = predicted_peak(cfg, validation_rows=10)
    check_fits_here(cfg, peak, available=2 * peak.total)  # 2 workers: just fits
    with pytest.raises(ConfigError) as refused:
        check_fits_here(cfg, peak, available=peak.total)
    message = str(refused.value)
    assert message.startswith(f"the run would need about {2 * peak.total / 2**30:.1f} GB (2 ")
    assert "training.activation_checkpointing: true" in message
    assert "training.host_memory: lean" in message and "\n" not in message
