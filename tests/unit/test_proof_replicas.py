"""Whole-model replicas against references written out here, on a 2-process gloo group: what
each worker applies under top-k and PowerSGD compression is the error-feedback recurrence
computed by hand, and local SGD with a period of 3 is local SGD steps per worker between
averages.

Each worker runs raylane's own code (the strategies' `train_step`, `register_compression`,
`average_gradients` with a `GroupAverager`, `LocalSGD`), on its own shard of the data. The
references run in each process alone, with no collectives: every worker's gradients are
computed on a plain copy of the model at the reference's parameters, and the recurrence is
applied to them. One spawn runs these checks with the other modules' (`tests.unit.gloo`).

Tolerance: 1e-6 absolute (`ATOL`) on every gradient applied and every parameter; measured 0.0
for all three. The same kernels compute the same gradients in both, top-k's selection does not
depend on the order of the entries, PowerSGD's reference takes torch's steps in torch's order,
and halving is exact in binary floating point (the sum of two halves is the half of the sum).
The tolerance leaves room for last-bit differences a BLAS may make between differently aligned
copies; what compression changes is 1e-2, what a step carries to the next as much.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylane.config import load_config
from raylane.config.schema import ModelConfig
from raylane.models import MLPClassifier, build_model
from raylane.models.losses import cross_entropy
from raylane.models.optim import build_optimizer
from raylane.parallel.collectives import average_gradients
from raylane.parallel.ddp import DataParallel
from raylane.parallel.grad_compression import GroupAverager
from raylane.parallel.local_sgd import LocalSGD
from tests.readme_blocks import ROOT

from .gloo import by_rank

WORLD, LR, ROWS, SEQ = 2, 0.5, 4, 16
GPT = ModelConfig(kind="gpt", input_dim=SEQ, num_classes=256, d_model=32, n_heads=4, n_layers=2)
TOPK_RATIO, TOPK_STEPS = 0.05, 4
POWERSGD_START, POWERSGD_STEPS = 2, 5  # raylane's PowerSGD compresses from its 3rd step on
PERIOD, LOCAL_STEPS = 3, 6
ATOL = 1e-6


def _config(*overrides: str):
    """The config a worker of the layout gets: plain SGD (`LR`), the small GPT."""
    return load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        ["parallelism.pp=1", f"parallelism.dp={WORLD}", "training.optimizer=sgd",
         f"training.lr={LR}", "training.weight_decay=0", f"model.input_dim={SEQ}",
         "model.d_model=32", "model.n_layers=2", *overrides],
    )  # fmt: skip


def _gpt(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(GPT)


def _tokens(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `rank`'s batch of step `step`: its own shard of the data."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, GPT.num_classes, (ROWS, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _features(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `rank`'s rows of step `step` for the classifier."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 24, generator=generator), torch.randint(0, 2, (8,), generator=generator)


def _local_grads(plain: nn.Module, params: dict, batch) -> dict[str, torch.Tensor]:
    """The gradients of one worker's mean loss on `batch`, at `params` (a plain model)."""
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(params[name])
    plain.zero_grad(set_to_none=True)
    cross_entropy(plain(batch[0]), batch[1]).backward()
    return {name: param.grad.clone() for name, param in plain.named_parameters()}


def _sgd(params: dict, applied: dict) -> dict:
    return {name: p.add(applied[name], alpha=-LR) for name, p in params.items()}


def _max_error(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


# --- top-k with error feedback ------------------------------------------------------------


def _topk_reference(initial: nn.Module) -> dict:
    """e_{t+1} = g_t + e_t - C(g_t + e_t) on each worker, C keeping the largest `TOPK_RATIO`
    of the entries of all the model's gradients together (they fit one DDP bucket, 1 MB);
    applied = the mean of the workers' C(...)."""
    plain = copy.deepcopy(initial)
    params = {n: p.detach().clone() for n, p in plain.named_parameters()}
    names = list(params)

    def flat(tensors: dict) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in names])

    residuals = [torch.zeros_like(flat(params)) for _ in range(WORLD)]
    applied_steps, dense_gap, residual_max = [], 0.0, 0.0
    for step in range(TOPK_STEPS):
        grads = [flat(_local_grads(plain, params, _tokens(w, step))) for w in range(WORLD)]
        sent = []
        for worker, grad in enumerate(grads):
            accumulated = grad + residuals[worker]
            k = max(1, int(accumulated.numel() * TOPK_RATIO))
            kept = torch.zeros_like(accumulated)
            top = accumulated.abs().topk(k).indices
            kept[top] = accumulated[top]
            residuals[worker] = accumulated - kept
            residual_max = max(residual_max, residuals[worker].abs().max().item())
            sent.append(kept)
        applied_flat = (sent[0] + sent[1]) / WORLD
        dense_gap = max(dense_gap, (applied_flat - (grads[0] + grads[1]) / WORLD).abs().max())
        parts = torch.split(applied_flat, [params[n].numel() for n in names])
        applied = {n: a.view_as(params[n]) for n, a in zip(names, parts, strict=True)}
        applied_steps.append(applied)
        params = _sgd(params, applied)
    return {"applied": applied_steps, "dense_gap": float(dense_gap), "residual": residual_max}


def _per_step_errors(got: list[dict], reference: dict) -> dict:
    return {
        "errors": [_max_error(g, r) for g, r in zip(got, reference["applied"], strict=True)],
        "dense_gap": reference["dense_gap"],
        "residual": reference["residual"],
    }


def _ddp_applied(rank: int, compression: str, initial: nn.Module, batch_of, steps: int):
    """The gradient each of `steps` DDP steps applied, with the wrapper and hook
    `DataParallel.wrap_model` sets up and the strategy's own `train_step`."""
    cfg = _config("parallelism.strategy=ddp", f"parallelism.grad_compression={compression}",
                  f"parallelism.topk_ratio={TOPK_RATIO}")  # fmt: skip
    strategy = DataParallel(cfg, rank)
    model = strategy.wrap_model(copy.deepcopy(initial))
    assert isinstance(model, DistributedDataParallel)
    optimizer = build_optimizer(model.parameters(), "sgd", LR, 0.0)
    applied = []
    for step in range(steps):
        strategy.train_step(model, optimizer, cross_entropy, *batch_of(rank, step))
        applied.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
    return applied


def _check_topk_ddp(rank: int) -> dict:
    initial = _gpt()
    applied = _ddp_applied(rank, "topk", initial, _tokens, TOPK_STEPS)
    return _per_step_errors(applied, _topk_reference(initial))


def _check_topk_flat(rank: int) -> dict:
    """Top-k on one flat buffer of every gradient (`average_gradients` with a `GroupAverager`,
    what the replicas of a tensor-parallel model run)."""
    initial = _gpt()
    model = copy.deepcopy(initial)
    averager = GroupAverager("topk", None, TOPK_RATIO)
    optimizer = build_optimizer(model.parameters(), "sgd", LR, 0.0)
    applied = []
    for step in range(TOPK_STEPS):
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = _tokens(rank, step)
        cross_entropy(model(inputs), targets).backward()
        average_gradients(model, None, WORLD, averager)
        applied.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return _per_step_errors(applied, _topk_reference(initial))


# --- PowerSGD -------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    """Two weights PowerSGD compresses at rank 1 (16x24 and 12x16: (n + m) * 2 < n * m); the
    2x12 head and the biases it all-reduces in full."""
    torch.manual_seed(0)
    return MLPClassifier(24, [16, 12], 2, 1.0)


# The order DDP's rebuilt bucket holds the compressed weights in (the order backward produced
# their gradients: the last layer first), which is the order torch draws their first Qs in.
COMPRESSED = ("net.2.weight", "net.0.weight")


def _powersgd_step(accumulated: list[dict], qs: dict, rng) -> dict:
    """One compressed step of torch's PowerSGD as raylane configures it (rank 1, error
    feedback, warm start, seed 0): P = sum_w M_w q / |q|, normalised; Q = mean_w M_w^T P;
    applied P Q^T; every other tensor the plain mean. Updates `qs` (warm start)."""
    if not qs:  # the first compressed step draws each Q from one seed, in bucket order
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng.randint(1_000_000_000))
            for name in COMPRESSED:
                qs[name] = torch.randn(1, accumulated[0][name].shape[1], 1)
    applied = {
        name: sum(acc[name] for acc in accumulated) / WORLD
        for name in accumulated[0]
        if name not in COMPRESSED
    }
    for name in COMPRESSED:
        q = qs[name] / qs[name].norm()
        p = sum(torch.bmm(acc[name].unsqueeze(0), q) for acc in accumulated)
        p = p / p.norm()
        qs[name] = sum(torch.bmm(acc[name].t().unsqueeze(0), p) for acc in accumulated) / WORLD
        applied[name] = torch.bmm(p, qs[name].transpose(1, 2))[0]
    return applied


def _powersgd_reference(initial: nn.Module) -> dict:
    """Plain all-reduce for `POWERSGD_START` steps; then M_w = g_w + e_w, applied = the
    PowerSGD approximation of the workers' M_w, e_w <- M_w - applied (torch's error feedback:
    each worker keeps what the shared approximation missed of its own M_w)."""
    plain = copy.deepcopy(initial)
    params = {n: p.detach().clone() for n, p in plain.named_parameters()}
    errors = [{n: torch.zeros_like(p) for n, p in params.items()} for _ in range(WORLD)]
    qs: dict = {}
    rng = np.random.RandomState(0)
    applied_steps, dense_gap, residual_max = [], 0.0, 0.0
    for step in range(POWERSGD_STEPS):
        grads = [_local_grads(plain, params, _features(w, step)) for w in range(WORLD)]
        mean = {n: sum(g[n] for g in grads) / WORLD for n in params}
        if step < POWERSGD_START:
            applied = mean
        else:
            pairs = zip(grads, errors, strict=True)
            accumulated = [{n: g[n] + e[n] for n in params} for g, e in pairs]
            applied = _powersgd_step(accumulated, qs, rng)
            errors = [{n: acc[n] - applied[n] for n in params} for acc in accumulated]
            largest = max(v.abs().max().item() for e in errors for v in e.values())
            residual_max = max(residual_max, largest)
            dense_gap = max(dense_gap, _max_error(applied, mean))
        applied_steps.append(applied)
        params = _sgd(params, applied)
    return {"applied": applied_steps, "dense_gap": dense_gap, "residual": residual_max}


def _check_powersgd(rank: int) -> dict:
    initial = _mlp()
    applied = _ddp_applied(rank, "powersgd", initial, _features, POWERSGD_STEPS)
    return _per_step_errors(applied, _powersgd_reference(initial))


# --- local SGD ------------------------------------------------------------------------------


def _averages_after(step: int) -> bool:
    """Whether the replicas are averaged after step `step` (counted from 1): torch's
    `PeriodicModelAverager` (no warm-up) averages on its 0th, PERIOD-th, ... call, so after
    steps 1, 1 + PERIOD, 1 + 2 * PERIOD, ..."""
    return (step - 1) % PERIOD == 0


def _local_sgd_reference(initial: nn.Module) -> dict:
    """Each worker takes SGD steps on its own shard from its own parameters; after the steps
    `_averages_after` names, and at the end of the epoch, both take the mean of the two."""
    plain = copy.deepcopy(initial)
    start = {n: p.detach().clone() for n, p in plain.named_parameters()}
    replicas = [start] * WORLD
    history = []
    for step in range(1, LOCAL_STEPS + 1):
        replicas = [
            _sgd(replicas[w], _local_grads(plain, replicas[w], _tokens(w, step)))
            for w in range(WORLD)
        ]
        if _averages_after(step):
            mean = {n: (replicas[0][n] + replicas[1][n]) / WORLD for n in start}
            replicas = [mean] * WORLD
        history.append(replicas)
    final = {n: (replicas[0][n] + replicas[1][n]) / WORLD for n in start}
    return {"history": history, "final": final}


def _check_local_sgd(rank: int) -> dict:
    cfg = _config("parallelism.strategy=local_sgd", f"parallelism.local_sgd_period={PERIOD}")
    strategy = LocalSGD(cfg, rank)
    # Each worker builds its own initial weights; `wrap_model` gives every one rank 0's.
    model = strategy.wrap_model(_gpt(seed=rank))
    optimizer = build_optimizer(model.parameters(), "sgd", LR, 0.0)
    reference = _local_sgd_reference(_gpt(seed=0))
    errors, drift = [], []
    for step in range(1, LOCAL_STEPS + 1):
        strategy.train_step(model, optimizer, cross_entropy, *_tokens(rank, step))
        mine = {n: p.detach().clone() for n, p in model.named_parameters()}
        replicas = reference["history"][step - 1]
        errors.append(_max_error(mine, replicas[rank]))
        drift.append(_max_error(replicas[0], replicas[1]))
    stats = strategy.epoch_stats()  # averages the replicas (collective)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "errors": errors,
        "drift": drift,
        "final": _max_error(final, reference["final"]),
        "bytes_ratio": stats["comm_bytes_ratio"],
    }


# --- the spawned job ------------------------------------------------------------------------

CHECKS = {
    "topk_ddp": _check_topk_ddp,
    "topk_flat": _check_topk_flat,
    "powersgd": _check_powersgd,
    "local_sgd": _check_local_sgd,
}
TWO_PROCESS_CHECKS = {
    name: (lambda rank, _, check=check: check(rank)) for name, check in CHECKS.items()
}


@pytest.fixture(scope="module")
def results(two_processes) -> list[dict]:
    return by_rank(two_processes, __name__, CHECKS)


def _assert_recurrence(found: dict) -> None:
    print(f"max abs error per step {found['errors']}, against the dense mean "
          f"{found['dense_gap']:.3g}, largest residual {found['residual']:.3g}")  # fmt: skip
    assert max(found["errors"]) <= ATOL, found["errors"]
    # What the compression changes, and what it carries to the next step, are far larger
    # than the tolerance: a hook that averaged in full, or dropped the residual, would fail.
    assert found["dense_gap"] > 1e-3 and found["residual"] > 1e-3, found


# DDP rebuilds its gradient bucket after the first step, in the order backward produced the
# gradients: each parameter's residual must follow it into its new place (the flat buffer of
# tp replicas keeps one order).
@pytest.mark.parametrize("path", ["topk_flat", "topk_ddp"])
def test_topk_applies_the_error_feedback_recurrence(results, path):
    for found in results:
        _assert_recurrence(found[path])


def test_topk_on_ddp_sends_the_first_steps_top_entries(results):
    for found in results:
        assert found["topk_ddp"]["errors"][0] <= ATOL


def test_powersgd_applies_torchs_error_feedback_recurrence(results):
    for found in results:
        _assert_recurrence(found["powersgd"])


def test_local_sgd_is_local_steps_between_averages(results):
    for found in (r["local_sgd"] for r in results):
        print(f"local SGD: max abs error per step {found['errors']}, final {found['final']}, "
              f"replicas apart {found['drift']}")  # fmt: skip
        assert max(found["errors"]) <= ATOL and found["final"] <= ATOL, found
        # Apart between averages, equal right after each: the period is what was run.
        averaged = [_averages_after(step) for step in range(1, LOCAL_STEPS + 1)]
        assert [d == 0.0 for d in found["drift"]] == averaged, found["drift"]
        assert min(d for d, a in zip(found["drift"], averaged, strict=True) if not a) > 1e-3
        # The model's bytes sent after steps 1 and 4 and at the epoch's end, of 6 steps.
        assert found["bytes_ratio"] == 3 / LOCAL_STEPS
