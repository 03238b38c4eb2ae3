"""What a fine-tune holds: a LoRA run recomputes its blocks' activations unless its config says
otherwise, and a Llama recomputed in backward has the plain model's gradients exactly."""

from __future__ import annotations

import copy

import torch

from raylane.config import load_config
from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.models.losses import cross_entropy
from raylane.parallel.parallelize import checkpoint_blocks
from tests.readme_blocks import ROOT

LORA = ROOT / "configs" / "finetune" / "llama_lora.yaml"


def test_lora_recomputes_activations_unless_the_config_says():
    assert load_config(LORA).training.activation_checkpointing is True
    held = load_config(LORA, ["training.activation_checkpointing=false"])
    assert held.training.activation_checkpointing is False
    full = load_config(LORA, ["finetune.method=full"])  # every weight trained: as configured
    assert full.training.activation_checkpointing is False


def test_a_checkpointed_llama_has_the_plain_models_gradients():
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                         n_kv_heads=2, ffn_dim=128, max_positions=32))  # fmt: skip
    recomputed = checkpoint_blocks(copy.deepcopy(plain))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    saved = {}
    for name, model in (("plain", plain), ("recomputed", recomputed)):
        count = 0

        def pack(tensor):
            nonlocal count
            count += 1
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        saved[name] = count
    for (name, p), q in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert saved["recomputed"] < saved["plain"] / 2  # the blocks kept their inputs only
