"""Gradient compression and activation checkpointing do what they claim, on real torch.

Compression runs through a real DDP model in a one-process gloo group: the hook is on the
all-reduce path, so its effect shows in the gradients (fp16/bf16 rounding, PowerSGD's low-rank
approximation once it starts). Activation checkpointing keeps gradients identical while saving
fewer activation bytes for backward.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylane.config.schema import ModelConfig
from raylane.models import build_model
from raylane.parallel.grad_compression import register_compression
from raylane.parallel.parallelize import parallelize

GPT = ModelConfig(kind="gpt", input_dim=16, num_classes=256, d_model=32, n_heads=4, n_layers=2)


@pytest.fixture(scope="module")
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _grads(model: nn.Module, steps: int = 1) -> list[torch.Tensor]:
    """Gradients of the last of `steps` backward passes on fixed data."""
    torch.manual_seed(1)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    for _ in range(steps):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_fp16_hook_rounds_the_all_reduced_gradients(process_group):
    plain = _grads(DistributedDataParallel(_mlp()))
    model = DistributedDataParallel(_mlp())
    register_compression(model, "fp16")
    compressed = _grads(model)
    for exact, sent in zip(plain, compressed, strict=True):
        assert torch.equal(sent, exact.half().float())  # what crossed the wire, exactly
    assert any(not torch.equal(s, e) for s, e in zip(compressed, plain, strict=True))


def test_powersgd_sends_a_low_rank_approximation_once_it_starts(process_group):
    plain = _grads(DistributedDataParallel(_mlp()), steps=3)
    model = DistributedDataParallel(_mlp())
    register_compression(model, "powersgd")
    compressed = _grads(model, steps=3)  # steps 1-2 all-reduce in full, step 3 compresses
    weight = 2  # the 10x64 output layer's weight: sent as a rank-1 approximation
    assert torch.linalg.matrix_rank(plain[weight]) > 1
    assert torch.linalg.matrix_rank(compressed[weight], atol=1e-6) == 1
    error = (compressed[weight] - plain[weight]).norm() / plain[weight].norm()
    assert 0.01 < error < 1.0, error


def _saved_bytes_and_grads(model: nn.Module) -> tuple[int, list[torch.Tensor]]:
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(2)
    tokens = torch.randint(0, 256, (8, GPT.input_dim))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.reshape(-1, 256), tokens.roll(-1, 1).reshape(-1))
    loss.backward()
    return saved, [p.grad.clone() for p in model.parameters()]


def test_activation_checkpointing_keeps_gradients_and_saves_fewer_activations():
    torch.manual_seed(0)
    plain = build_model(GPT)
    torch.manual_seed(0)
    checkpointed = parallelize(build_model(GPT), None, activation_checkpointing=True)
    assert [n for n, _ in plain.named_parameters()] == [
        n for n, _ in checkpointed.named_parameters()
    ]  # checkpoints and the registry see the same names
    plain_bytes, plain_grads = _saved_bytes_and_grads(plain)
    ckpt_bytes, ckpt_grads = _saved_bytes_and_grads(checkpointed)
    for a, b in zip(plain_grads, ckpt_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ckpt_bytes < 0.6 * plain_bytes, (ckpt_bytes, plain_bytes)


def test_bf16_compression_is_refused_without_nccl():
    from raylane.config import ConfigError, load_config
    from tests.readme_blocks import ROOT

    with pytest.raises(ConfigError, match="'bf16' needs NCCL"):
        load_config(
            ROOT / "configs" / "train" / "digits_ddp.yaml", ["parallelism.grad_compression=bf16"]
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.grad_compression=powersgd", "parallelism.workers=4"],
         "'powersgd' compresses DDP's gradient buckets; strategy 'tp' averages"),
        (["parallelism.grad_compression=fp16"],
         "2 workers at tp 2 make one replica"),
        (["parallelism.strategy=fsdp", "parallelism.grad_compression=fp16",
          "parallelism.workers=4"],
         "(strategies 'ddp' and 'tp'); strategy 'fsdp' does not"),
    ],
)  # fmt: skip
def test_compression_names_the_layouts_it_applies_to(overrides, message):
    from raylane.config import ConfigError, load_config
    from tests.readme_blocks import ROOT

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ROOT / "configs" / "train" / "lm_tp.yaml", overrides)
