"""AdamW over a tensor-parallel model takes the path CUDA takes, on the CPU.

On CUDA AdamW defaults to its foreach (multi-tensor) path; a tensor-parallel plan leaves the
embeddings and norms plain tensors while the blocks' linears become DTensors, and one foreach
op over both stops with `got mixed torch.Tensor and DTensor` at the first step. Forcing
`foreach=True` on the CPU reproduces it in a one-process gloo group (a 1-rank mesh still makes
DTensors); `build_optimizer`'s grouping steps, and its update equals a plain model's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from raylane.models.gpt import GPT
from raylane.models.gpt_plan import block_plan
from raylane.models.losses import cross_entropy
from raylane.models.optim import build_optimizer, param_groups

LR, DECAY = 1e-2, 0.1


@pytest.fixture(scope="module")
def tp_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def _models(mesh):
    """A GPT and its tensor-parallel twin (the blocks by the GPT's plan, the rest plain)."""
    torch.manual_seed(0)
    plain = GPT(256, 16, 32, 4, 2)
    split = copy.deepcopy(plain)
    for block in split.blocks.values():
        parallelize_module(block, mesh, block_plan(False))
    return plain, split


def _backward(model) -> None:
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (4, 16))
    cross_entropy(model(tokens), tokens).backward()


def test_one_group_over_dtensors_and_plain_tensors_fails_as_on_cuda(tp_mesh):
    _, split = _models(tp_mesh)
    kinds = {isinstance(p, DTensor) for p in split.parameters()}
    assert kinds == {True, False}  # the plan left the embeddings, norms and head plain
    _backward(split)
    old = torch.optim.AdamW(split.parameters(), lr=LR, weight_decay=DECAY, foreach=True)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        old.step()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_grouped_optimizer_steps_a_tensor_parallel_model_as_a_plain_one(tp_mesh, kind):
    plain, split = _models(tp_mesh)
    _backward(plain)
    _backward(split)
    reference = build_optimizer(plain.parameters(), kind, LR, DECAY)
    grouped = build_optimizer(split.parameters(), kind, LR, DECAY, foreach=True)
    assert [g["foreach"] for g in grouped.param_groups] == [True, True]
    for group in grouped.param_groups:  # never a DTensor beside a plain tensor
        assert len({isinstance(p, DTensor) for p in group["params"]}) == 1
    initial = {name: p.detach().clone() for name, p in plain.named_parameters()}
    for _ in range(2):
        reference.step()
        grouped.step()
    for (name, want), got in zip(plain.named_parameters(), split.parameters(), strict=True):
        got = got.full_tensor() if isinstance(got, DTensor) else got
        assert not torch.equal(want, initial[name]), name  # it stepped
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_a_model_of_plain_cpu_tensors_keeps_one_unfused_group():
    """What every CPU run had: one group, torch's choice of path (checkpoints of the optimizer
    state keep their shape)."""
    model = GPT(256, 16, 32, 4, 2)
    groups = param_groups(model.parameters())
    assert len(groups) == 1 and set(groups[0]) == {"params"}
    assert groups[0]["params"] == list(model.parameters())
    optimizer = build_optimizer(model.parameters(), "adamw", LR, DECAY)
    assert optimizer.param_groups[0]["fused"] is None
    assert optimizer.param_groups[0]["foreach"] is None


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'; available: adamw, sgd"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], "lamb", LR, DECAY)


def test_a_restored_checkpoint_keeps_this_runs_kernel_choice(tmp_path):
    """Loading optimizer state replaces each group's settings with the saved ones: a checkpoint
    saved with torch's default path must not decide a run whose groups take another (a CUDA
    run's fused groups, here a forced foreach)."""
    from raylane.train.checkpointing import restore, save_checkpoint

    model = GPT(256, 16, 32, 4, 2)
    _backward(model)
    saved = build_optimizer(model.parameters(), "adamw", LR, DECAY)
    saved.step()
    save_checkpoint(tmp_path, model, saved, epoch=0, metrics={})
    resumed = build_optimizer(model.parameters(), "adamw", LR, DECAY, foreach=True)
    restore(tmp_path, model, resumed, model, 0)
    assert resumed.param_groups[0]["foreach"] is True
    state = next(iter(resumed.state.values()))
    assert int(state["step"]) == 1  # the state itself did come back
