"""What a fine-tune holds: a LoRA run recomputes its blocks' activations unless its config says
otherwise and gives freed host memory back, and a Llama recomputed in backward has the plain
model's gradients exactly."""

from __future__ import annotations

import copy
import subprocess
import sys

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


def test_lora_gives_freed_host_memory_back_unless_the_config_says():
    assert load_config(LORA).training.host_memory == "lean"
    assert load_config(LORA, ["training.host_memory=fast"]).training.host_memory == "fast"
    assert load_config(LORA, ["finetune.method=full"]).training.host_memory == "fast"


#: In a fresh process: allocate and free blocks of 2-24 MB (a model's weights and activations
#: are such blocks), then print how much more the process holds than before.
_HELD_AFTER_FREEING = """
import gc, sys, psutil, torch
sys.path.insert(0, {platform!r})
from raylane.runtime import apply_host_memory
applied = apply_host_memory({mode!r})
torch.ones(7 * 2**20)  # freed at once: glibc raises its threshold to 28 MB, later blocks stay
before = psutil.Process().memory_info().rss
blocks, small = [], []
for n in range(2, 26):  # n MB each, 300 MB in all, with small blocks after each
    blocks.append(torch.ones(int(n * 2**18)))
    small.append(torch.ones(64))
del blocks
gc.collect()
print(applied, (psutil.Process().memory_info().rss - before) // 2**20)
"""


def test_lean_host_memory_gives_freed_blocks_back_to_the_system():
    held = {}
    for mode in ("fast", "lean"):
        code = _HELD_AFTER_FREEING.format(platform=str(ROOT / "platform"), mode=mode)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        applied, held[mode] = done.stdout.split()
        assert applied == str(mode == "lean"), done.stderr[-2000:]
    assert int(held["lean"]) < 20, held  # the 300 MB went back
    assert int(held["fast"]) > 40, held  # kept by the default allocator


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
