"""`training.precision`: the config, the CPU's bf16 detection, a bf16 training step (autocast
over fp32 master weights) against fp32's, and what the measured cost model makes of bf16.

Every layout accepts bf16: gloo in torch 2.13 all-reduces, all-gathers and reduce-scatters bf16
tensors. Here only the config's acceptance is tested for FSDP2's bf16 policy, tensor
parallelism and pipeline stages (they trained under it in a one-off 2- and 4-process check
outside the suite); the equivalence test proves DDP's under Ray Train."""

from __future__ import annotations

import pytest
import torch

from raylane.config import ConfigError, load_config
from raylane.config.loader import flatten
from raylane.config.schema import ModelConfig
from raylane.models import build_model
from raylane.models.losses import cross_entropy
from raylane.parallel.base import StrategyDefaults
from raylane.parallel.precision import autocast_method, bf16_speed, cpu_bf16_flags
from raylane.plan.measured import predict_config
from tests.readme_blocks import ROOT

from .test_plan_measured import PROFILE

LM = ROOT / "configs" / "train" / "lm_pipeline.yaml"
GPT = ModelConfig(kind="gpt", input_dim=32, num_classes=256, d_model=64, n_heads=4, n_layers=2)
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse avx2 avx512f avx512_vnni {extra} arch_perfmon
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu vme sse avx2 avx512f avx512_vnni {extra} arch_perfmon
"""


@pytest.mark.parametrize(
    "layout",
    [
        [],  # the config's pipeline
        ["parallelism.strategy=fsdp", "parallelism.pp=1", "parallelism.dp=2"],
        ["parallelism.strategy=tp", "parallelism.pp=1", "parallelism.tp=2"],
        ["parallelism.strategy=ddp", "parallelism.pp=1", "parallelism.dp=2"],
    ],
)
def test_every_layout_accepts_bf16_and_the_run_records_it(layout):
    cfg = load_config(LM, [*layout, "training.precision=bf16"])
    assert cfg.training.precision == "bf16"
    assert flatten(cfg.model_dump(mode="json"))["training.precision"] == "bf16"  # MLflow param
    assert load_config(LM, layout).training.precision == "fp32"  # the default


def test_an_unknown_precision_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as raised:
        load_config(LM, ["training.precision=fp16"])
    assert str(raised.value) == (
        f"{LM}: training.precision: Input should be 'fp32', 'tf32' or 'bf16'"
    )


@pytest.mark.parametrize(
    ("extra", "flags"),
    [
        ("avx512_bf16 amx_bf16 amx_tile", ["avx512_bf16", "amx_bf16"]),
        ("avx512_bf16", ["avx512_bf16"]),
        ("", []),
    ],
)
def test_cpu_bf16_flags_are_read_from_cpuinfo(extra, flags):
    assert cpu_bf16_flags(CPUINFO.format(extra=extra)) == flags


def test_the_bf16_line_says_fast_or_emulated(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.write_text(CPUINFO.format(extra="avx512_bf16"))
    slow.write_text(CPUINFO.format(extra=""))
    assert bf16_speed(False, fast) == (
        True,
        "bf16: this CPU has avx512_bf16: bf16 matmuls in hardware, faster than fp32 once the "
        "matrices are large",
    )
    is_fast, line = bf16_speed(False, slow)
    assert not is_fast and "emulated, expect it slower than fp32" in line
    assert not bf16_speed(False, tmp_path / "missing")[0]


class _Step(StrategyDefaults):
    """The one training step, on one process."""

    def __init__(self, precision: str):
        self.precision = precision
        self.last_step_parts: dict[str, float] = {}


def _train(precision: str, steps: int = 3):
    torch.manual_seed(0)
    model = build_model(GPT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = _Step(precision)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (4, 33), generator=generator)
        loss = step.train_step(model, optimizer, cross_entropy, tokens[:, :-1], tokens[:, 1:])
        losses.append(loss.item())
    evaluated = step.forward(model, tokens[:, :-1], tokens[:, 1:])
    return model, optimizer, losses, evaluated


def test_a_bf16_step_keeps_fp32_master_weights_and_fp32_s_loss():
    model, optimizer, losses, evaluated = _train("bf16")
    _, _, fp32_losses, _ = _train("fp32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    moments = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    assert evaluated.dtype == torch.float32
    for got, want in zip(losses, fp32_losses, strict=True):
        assert got == pytest.approx(want, rel=2e-2)
    assert losses != fp32_losses  # bf16 did run


def test_a_bf16_forward_computes_in_bf16():
    seen = []
    model = build_model(GPT)
    model.head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    step = _Step("bf16")
    tokens = torch.randint(0, 256, (2, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step.train_step(model, optimizer, cross_entropy, tokens, tokens)
    assert seen == [torch.bfloat16]


def test_autocast_method_wraps_only_that_method():
    class Stage:
        def forward_one_chunk(self):
            return torch.is_autocast_enabled("cpu")

        def backward_one_chunk(self):
            return torch.is_autocast_enabled("cpu")

    stage = Stage()
    autocast_method(stage, "forward_one_chunk", "bf16", torch.device("cpu"))
    assert stage.forward_one_chunk() and not stage.backward_one_chunk()


def _predict(*overrides: str):
    return predict_config(PROFILE, load_config(LM, list(overrides)))


def test_the_cost_model_halves_bf16_activations_and_fsdp_gathers():
    fsdp = ["parallelism.strategy=fsdp", "parallelism.pp=1", "parallelism.dp=2"]
    fp32, bf16 = _predict(*fsdp), _predict(*fsdp, "training.precision=bf16")
    assert bf16.memory_mb < fp32.memory_mb
    assert bf16.parts["comm"] < fp32.parts["comm"]  # all-gathers in bf16, reduce-scatter fp32
    assert bf16.parts["compute"] == fp32.parts["compute"]  # the profile is fp32
