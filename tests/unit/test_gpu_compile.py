"""`training.compile`: each block compiled the regional way gives the eager model's loss and
gradients, keeps the plain model's parameter names, and traces activation checkpointing.

The run compiles with inductor; these tests pass torch.compile's `aot_eager` backend through
`parallelize` (the same graph capture and autograd split, no code generation), which is cheap
enough for the CPU suite. Tolerance: 1e-6 relative (aot_eager replays the same ATen ops, so
the figures agree to float32 rounding; measured equal to the last bit on torch 2.13).
"""

from __future__ import annotations

import copy

import pytest
import torch

from raylane.config import load_config
from raylane.models.gpt import GPT
from raylane.models.losses import cross_entropy
from raylane.parallel.meters import ActivationMeter
from raylane.parallel.parallelize import parallelize
from tests.unit.test_config import ROOT

LM = ROOT / "configs" / "train" / "lm_pipeline.yaml"


def _loss_and_grads(model, rows: int):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rows)
    tokens = torch.randint(0, 256, (rows, 16))
    with ActivationMeter() as meter:  # the loop meters every step with saved-tensor hooks
        loss = cross_entropy(model(tokens), tokens)
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, meter.peak_bytes


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_blocks_train_as_the_eager_model(checkpointing):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = GPT(256, 16, 32, 4, 3)
    names = [name for name, _ in eager.named_parameters()]
    compiled = parallelize(
        copy.deepcopy(eager),
        None,
        activation_checkpointing=checkpointing,
        compile_blocks=True,
        compile_backend="aot_eager",
    )
    parallelize(eager, None, activation_checkpointing=checkpointing)
    counters.clear()
    for rows in (3, 5):  # a second shape: one dynamic graph serves the rest
        want_loss, want_grads, _ = _loss_and_grads(eager, rows)
        got_loss, got_grads, got_peak = _loss_and_grads(compiled, rows)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
        for name in names:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-6, atol=1e-8)
    assert [name for name, _ in compiled.named_parameters()] == names
    # The blocks were compiled (not skipped as a frame torch.compile does not trace): every
    # block shares a graph, so a few graphs serve three blocks at two shapes.
    assert 1 <= counters["stats"]["unique_graphs"] <= 3
    if checkpointing:  # the compiled region still recomputes: it keeps far less for backward
        whole = parallelize(
            GPT(256, 16, 32, 4, 3), None, compile_blocks=True, compile_backend="aot_eager"
        )
        assert got_peak < 0.5 * _loss_and_grads(whole, 5)[2]


def test_compile_is_off_by_default_and_recorded_with_the_run():
    from raylane.config.loader import flatten

    assert load_config(LM).training.compile is False
    cfg = load_config(LM, ["training.compile=true"])
    assert flatten(cfg.model_dump(mode="json"))["training.compile"] is True  # an MLflow param


def test_compile_with_context_parallelism_is_one_line_naming_the_field():
    from raylane.config import ConfigError

    overrides = ["training.compile=true", "parallelism.strategy=ddp", "parallelism.pp=1",
                 "parallelism.workers=2", "parallelism.dp=1", "parallelism.cp=2"]  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        load_config(LM, overrides)
    message = str(raised.value)
    assert "training.compile" in message and "parallelism.cp 2" in message
    assert "\n" not in message
