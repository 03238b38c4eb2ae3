"""Layouts against the plain model, on a 2-process gloo group: activation checkpointing on
DDP; a pipeline cut unevenly by `split_points` (block 0 on one stage, blocks 1-2 on the other),
alone and with every stage's blocks checkpointed; bf16 mixed precision on FSDP2, tensor
parallelism, pipeline stages and context parallelism, against the plain model under the same
autocast.

Each worker runs raylane's own strategy (`DataParallel`, `PipelineParallel`, `MeshParallel`:
their model wrapping and `train_step`; for bf16, the one `get_strategy` picks) on the config it
would get; the plain model runs in each
process alone on the whole batch. The checks run in the spawn `test_proof_replicas` starts.

Tolerances. fp32: the mean of two micro-batches' (or replicas') mean losses against the mean
over the whole batch, and the same for the gradients: measured within 8.3e-8 relative (one
float32 ulp of a loss of 5.6) and 2.3e-8 absolute; asserted 1e-6 for both (`FP32_TOLERANCE`;
the gradients are about 1e-2). bf16 (8-bit mantissa, unit roundoff 2**-8 = 3.9e-3): both sides
compute the matmuls in bf16 but round at other points: FSDP2 gathers every parameter in bf16
(the norms' and embeddings' too, which autocast leaves in fp32) and each worker's gradient is a
bf16 GEMM over its own half of the rows; tensor parallelism rounds each worker's partial sums
to bf16 before the all-reduce adds them. Measured: losses within 1.1e-4 relative, parameters
after one step within 1.4e-4 absolute; asserted 5e-4 and 1e-3 (`BF16_TOLERANCE`, 5x and 7x),
where the step moves parameters by up to 2.1e-2: a gradient shard dropped or scaled wrongly
fails. That the layout computed in bf16 is checked apart: its head's output dtype in the step.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from raylane.config import load_config
from raylane.config.schema import ModelConfig
from raylane.models import build_model
from raylane.models.losses import cross_entropy
from raylane.models.optim import build_optimizer
from raylane.parallel.ddp import DataParallel
from raylane.parallel.pipeline import PipelineParallel
from raylane.parallel.registry import get_strategy
from tests.readme_blocks import ROOT

from .gloo import by_rank

LR, ROWS, SEQ, LAYERS = 0.5, 8, 16, 3
GPT = ModelConfig(kind="gpt", input_dim=SEQ, num_classes=256, d_model=32, n_heads=4,
                  n_layers=LAYERS)  # fmt: skip
STEPS = 2
FP32_TOLERANCE = {"loss_rel": 1e-6, "grad_atol": 1e-6}
BF16_TOLERANCE = {"loss_rel": 5e-4, "param_atol": 1e-3}
PIPELINES = {  # name: config overrides
    "uneven split": ["parallelism.schedule=gpipe"],
    "uneven split, 1f1b, checkpointed stages": [
        "parallelism.schedule=1f1b",
        "training.activation_checkpointing=true",
    ],
}
# name: (config overrides, each worker trains on its own half of the rows, workers reporting
# the loss: their mean is the whole batch's, each over an equal part of it)
BF16_LAYOUTS = {
    "fsdp2": (["parallelism.strategy=fsdp", "parallelism.dp=2", "parallelism.tp=1"], True, 2),
    "tp2": (["parallelism.strategy=tp", "parallelism.dp=1", "parallelism.tp=2"], False, 1),
    # The last stage reports the mean of its 2 micro-batches' losses.
    "pp2": (["parallelism.strategy=pipeline", "parallelism.pp=2", "parallelism.dp=1",
             "parallelism.split_points=[1]", "parallelism.microbatches=2"], False, 1),
    # Each worker computes on its chunks of every sequence (ring attention) and reports their
    # mean loss.
    "cp2": (["parallelism.strategy=ddp", "parallelism.dp=1", "parallelism.cp=2"], False, 2),
}  # fmt: skip


def _config(*overrides: str):
    return load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        [
            "training.optimizer=sgd",
            f"training.lr={LR}",
            "training.weight_decay=0",
            f"model.input_dim={SEQ}",
            "model.d_model=32",
            f"model.n_layers={LAYERS}",
            *overrides,
        ],
    )


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return build_model(GPT)


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of step `step`."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, GPT.num_classes, (ROWS, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _plain_step(model: nn.Module, inputs, targets, bf16: bool = False) -> tuple[float, dict]:
    """Loss and gradients of the plain model (under bf16 autocast if `bf16`), then SGD."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outputs = model(inputs)
    loss = cross_entropy(outputs.float(), targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(param.grad, alpha=-LR)
    return loss.item(), grads


def _relative(got: float, expected: float) -> float:
    return abs(got - expected) / abs(expected)


def _max_error(got: dict, expected: dict) -> float:
    return max((got[name] - expected[name]).abs().max().item() for name in got)


def _checkpointed(module: nn.Module) -> list[bool]:
    return [
        isinstance(b.forward, functools.partial) and b.forward.func is checkpoint
        for b in module.blocks.values()
    ]


def _check_ddp_checkpointing(rank: int) -> dict:
    """Two DDP steps with checkpointed blocks, each worker on its half of the rows (the hook
    and wrapper `DataParallel.wrap_model` sets up on a CPU worker: `parallelize`'s last step),
    against the plain model."""
    cfg = _config("parallelism.strategy=ddp", "parallelism.pp=1", "parallelism.dp=2",
                  "training.activation_checkpointing=true")  # fmt: skip
    strategy = DataParallel(cfg, rank)
    plain = _gpt()
    model = strategy.wrap_model(copy.deepcopy(plain))
    placed = model.module
    optimizer = build_optimizer(model.parameters(), "sgd", LR, 0.0)
    half = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2)
    loss_errors, grad_errors = [], []
    for step in range(STEPS):
        inputs, targets = _tokens(step)
        loss = strategy.train_step(model, optimizer, cross_entropy, inputs[half], targets[half])
        with torch.no_grad():
            expected_loss = cross_entropy(plain(inputs[half]), targets[half]).item()
        loss_errors.append(_relative(loss.item(), expected_loss))
        _, expected_grads = _plain_step(plain, inputs, targets)
        grads = {n: p.grad for n, p in model.module.named_parameters()}
        grad_errors.append(_max_error(grads, expected_grads))
    ddp = isinstance(model, DistributedDataParallel)
    return {"checkpointed": _checkpointed(placed), "loss_errors": loss_errors,
            "grad_errors": grad_errors, "ddp": ddp}  # fmt: skip


def _check_pipeline(rank: int, overrides: list[str]) -> dict:
    """Two steps of a 2-stage pipeline cut after block 0 (2 micro-batches), against the plain
    model's steps on the whole batch: the last stage's loss, each stage's gradients."""
    cfg = _config("parallelism.strategy=pipeline", "parallelism.pp=2", "parallelism.dp=1",
                  "parallelism.split_points=[1]", "parallelism.microbatches=2",
                  *overrides)  # fmt: skip
    strategy = PipelineParallel(cfg, rank)
    plain = _gpt()
    stage = strategy.wrap_model(copy.deepcopy(plain))
    optimizer = build_optimizer(stage.parameters(), "sgd", LR, 0.0)
    loss_errors, grad_errors = [], []
    for step in range(STEPS):
        loss = strategy.train_step(stage, optimizer, cross_entropy, *_tokens(step))
        expected_loss, expected_grads = _plain_step(plain, *_tokens(step))
        grads = {n: p.grad for n, p in stage.named_parameters()}
        grad_errors.append(_max_error(grads, expected_grads))
        if loss is not None:
            loss_errors.append(_relative(loss.item(), expected_loss))
    return {
        "blocks": list(stage.blocks.keys()),
        "names": [n for n, _ in stage.named_parameters()],
        "checkpointed": _checkpointed(stage),
        "loss_errors": loss_errors,
        "grad_errors": grad_errors,
    }


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _check_bf16(rank: int, overrides: list[str], halves: bool) -> dict:
    """One bf16 step of the layout (the strategy its config gets) against the plain model's
    under the same autocast: the worker's loss, and its parameters after the step against the
    plain model's after its step on the whole batch."""
    cfg = _config("parallelism.pp=1", "training.precision=bf16", *overrides)
    strategy = get_strategy(cfg, rank)
    plain = _gpt()
    model = strategy.wrap_model(copy.deepcopy(plain))
    dtypes = []
    head = getattr(model, "head", None)  # a pipeline's first stage has none
    if head is not None:
        head.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    optimizer = build_optimizer(model.parameters(), "sgd", LR, 0.0)
    inputs, targets = _tokens(0)
    rows = slice(rank * ROWS // 2, (rank + 1) * ROWS // 2) if halves else slice(None)
    mine = strategy.local_batch(inputs[rows], targets[rows])
    loss = strategy.train_step(model, optimizer, cross_entropy, *mine)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        own_loss = cross_entropy(plain(inputs[rows]).float(), targets[rows]).item()
    initial = {n: p.detach().clone() for n, p in plain.named_parameters()}
    expected_loss, _ = _plain_step(plain, inputs, targets, bf16=True)
    expected = {n: p.detach() for n, p in plain.named_parameters()}
    params = {n: _full(p).detach() for n, p in model.named_parameters()}
    return {
        "head_dtypes": dtypes,
        "has_head": head is not None,
        "loss": loss.item() if strategy.reports_loss and loss is not None else None,
        "expected_loss": expected_loss,
        "own_expected_loss": own_loss,  # the plain model's on this worker's rows
        "param_error": _max_error(params, expected),
        "moved": _max_error(expected, initial),
    }


CHECKS = {
    "ddp, checkpointed blocks": _check_ddp_checkpointing,
    **{name: functools.partial(_check_pipeline, overrides=o) for name, o in PIPELINES.items()},
    **{name: functools.partial(_check_bf16, overrides=o, halves=h)
       for name, (o, h, _) in BF16_LAYOUTS.items()},
}  # fmt: skip


TWO_PROCESS_CHECKS = {
    name: (lambda rank, _, check=check: check(rank)) for name, check in CHECKS.items()
}


@pytest.fixture(scope="module")
def results(two_processes) -> list[dict]:
    return by_rank(two_processes, __name__, CHECKS)


def test_ddp_with_checkpointed_blocks_equals_the_plain_model(results):
    for found in (r["ddp, checkpointed blocks"] for r in results):
        print(f"DDP, checkpointed blocks: {found}")
        assert found["ddp"]  # `parallelize` ended with DDP over the two workers
        assert found["checkpointed"] == [True] * LAYERS  # every block recomputed in backward
        assert max(found["loss_errors"]) <= FP32_TOLERANCE["loss_rel"], found
        assert max(found["grad_errors"]) <= FP32_TOLERANCE["grad_atol"], found


@pytest.mark.parametrize("name", list(PIPELINES))
def test_uneven_pipeline_equals_the_plain_model(results, name):
    first, last = results[0][name], results[1][name]
    print(f"{name}: relative loss errors {last['loss_errors']}, gradient errors "
          f"{first['grad_errors']} / {last['grad_errors']}")  # fmt: skip
    assert (first["blocks"], last["blocks"]) == (["0"], ["1", "2"])  # cut where split_points says
    # Between them the stages hold every parameter of the plain model, under its names.
    assert sorted(first["names"] + last["names"]) == sorted(n for n, _ in _gpt().named_parameters())
    checkpointed = "activation_checkpointing=true" in " ".join(PIPELINES[name])
    assert first["checkpointed"] == [checkpointed] and last["checkpointed"] == [checkpointed] * 2
    assert len(last["loss_errors"]) == STEPS and first["loss_errors"] == []
    assert max(last["loss_errors"]) <= FP32_TOLERANCE["loss_rel"]
    assert max(first["grad_errors"] + last["grad_errors"]) <= FP32_TOLERANCE["grad_atol"]


@pytest.mark.parametrize("name", list(BF16_LAYOUTS))
def test_bf16_layout_is_within_bf16_rounding_of_the_plain_model(results, name):
    reported = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
    assert len(reported) == BF16_LAYOUTS[name][2]
    assert any(r[name]["has_head"] for r in results)
    for found in (r[name] for r in results):
        print(f"bf16 {name}: {found}")
        if found["has_head"]:  # the step's forwards ran in bf16 (a micro-batch each)
            dtypes = found["head_dtypes"]
            if name == "pp2":  # after the schedule's shape inference, run once outside autocast
                assert dtypes[0] == torch.float32
                dtypes = dtypes[1:]
            assert dtypes == [torch.bfloat16] * (2 if name == "pp2" else 1), found["head_dtypes"]
        assert found["param_error"] <= BF16_TOLERANCE["param_atol"] < found["moved"] / 10
    if BF16_LAYOUTS[name][1]:  # each replica's loss is the plain model's on its own rows
        for found in (r[name] for r in results):
            rel = BF16_TOLERANCE["loss_rel"]
            assert found["loss"] == pytest.approx(found["own_expected_loss"], rel=rel), found
    # Equal parts of the whole batch (rows, micro-batches, sequence chunks): their mean loss is
    # the plain model's on the whole batch.
    expected = results[0][name]["expected_loss"]
    got = sum(reported) / len(reported)
    assert got == pytest.approx(expected, rel=BF16_TOLERANCE["loss_rel"]), (got, expected)
