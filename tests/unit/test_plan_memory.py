"""The model-state memory model against a published table and against real models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel

from raylane.config.layout import stage_boundaries
from raylane.models.gpt import GPT
from raylane.models.gpt_plan import block_plan
from raylane.models.shape import DecoderShape
from raylane.parallel.meters import model_state_bytes
from raylane.parallel.pipeline import build_stage_module
from raylane.plan.memory import FP32_ADAM, sharded_state

GB = 1e9
SHAPES = [
    DecoderShape.gpt(256, 64, 64, 4),
    DecoderShape.gpt(256, 64, 128, 4),
    DecoderShape.gpt(1000, 32, 96, 6),
]


def _gpt(shape: DecoderShape) -> GPT:
    return GPT(shape.vocab_size, shape.context_length, shape.d_model, 4, shape.n_layers)


@pytest.mark.parametrize(
    ("stage", "published_gb"),
    # ZeRO (Rajbhandari et al., SC 2020), Figure 1: a 7.5B-parameter model on 64 data-parallel
    # devices with mixed-precision Adam (K = 12): baseline, P_os, P_os+g, P_os+g+p.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_per_device_model_state_matches_the_zero_papers_figure(stage, published_gb):
    """To the figure's (and the README's) one decimal: 120.0, 31.4, 16.6 and 1.9 GB."""
    predicted = sharded_state(7.5e9, dp=64, zero_stage=stage).total / GB
    assert round(predicted, 1) == published_gb


@pytest.mark.parametrize("shape", SHAPES)
def test_gpt_parameter_count_is_the_models_own(shape):
    assert shape.total() == sum(p.numel() for p in _gpt(shape).parameters())


@pytest.mark.parametrize("shape", SHAPES)
def test_tensor_parallel_share_follows_raylanes_own_plan(shape):
    """What a tp=2 device holds, counted from the plan's styles on the real model: column-wise
    layers split weight and bias, row-wise layers only the weight."""
    model, tp = _gpt(shape), 2
    held = 0.0
    for name, param in model.named_parameters():
        module_name, kind = name.rsplit(".", 1)
        style = next(
            (s for key, s in block_plan().items() if module_name.endswith(f".{key}")), None
        )
        split = style is not None and (kind == "weight" or isinstance(style, ColwiseParallel))
        held += param.numel() / tp if split else param.numel()
    assert shape.params_per_device(tp=tp) == pytest.approx(held)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_pipeline_stage_share_is_the_stage_modules_own(shape):
    bounds = stage_boundaries(shape.n_layers, 2, None)
    for stage in range(2):
        module = build_stage_module(copy.deepcopy(_gpt(shape)), stage, bounds)
        assert shape.params_per_device(pp=2, stage=stage) == sum(
            p.numel() for p in module.parameters()
        )


def test_predicted_fp32_adam_state_matches_what_a_worker_measures():
    shape = SHAPES[1]
    model = _gpt(shape)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    predicted = sharded_state(shape.total(), dp=1, zero_stage=0, per_param=FP32_ADAM)
    assert measured["param"] == predicted.param and measured["grad"] == predicted.grad
    # Adam's per-tensor step counters come on top of the two moments.
    assert measured["optimizer_state"] == pytest.approx(predicted.optimizer, rel=1e-3)


def test_impossible_layouts_are_refused():
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        sharded_state(1e9, dp=8, zero_stage=4)
    with pytest.raises(ValueError, match=r"n_layers \(4\) is not divisible by pp \(3\)"):
        SHAPES[0].params_per_device(pp=3)
