"""The Llama split into pipeline stages (`build_stage_module`, driven by torch's GPipe schedule)
and over context-parallel workers (`apply_context_parallel`: each worker its zig-zag chunks of
every sequence, rotary positions by global index, grouped-query attention by ring attention)
against the same weights unsplit, over a 2-process gloo group: the loss, and every parameter's
gradient after one backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.models.losses import cross_entropy
from raylane.parallel.parallelize import apply_context_parallel
from raylane.parallel.pipeline import build_stage_module
from raylane.parallel.ring_attention import gather_sequence, shard_sequence

# Grouped-query attention (4 query heads, 2 key/value heads) and rope_theta other than the
# default, so that positions and head groups both matter.
CONFIG = LlamaConfig(vocab_size=96, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                     ffn_dim=128, max_positions=16, rope_theta=500.0)  # fmt: skip
BATCH, SEQ, MICROBATCHES = 4, 16, 2
# Measured on CPU (fp32): the pipeline's loss exact, the context-parallel logits within 2.1e-7
# (ring attention's log-sum-exp merge), gradients within 6e-8 (summation orders), where the
# largest gradients are ~1e-1; about 5x and 15x the measured errors are asserted.
LOSS_ATOL = GRAD_ATOL = 1e-6


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _plain(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    inputs, targets = _batch()
    loss = cross_entropy(model(inputs), targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipeline(model: LlamaForCausalLM, rank: int, group) -> tuple[float, dict]:
    """Stage `rank` of 2 (blocks 0-1 with the embedding, 2-3 with the norm and head), GPipe
    over 2 micro-batches; the loss from the last stage, each stage's own gradients."""
    stage_model = build_stage_module(model, rank, [0, 2, 4])
    stage = PipelineStage(stage_model, rank, 2, torch.device("cpu"), group=group)
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=cross_entropy)
    inputs, targets = _batch()
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=losses)
    loss = torch.stack(losses).mean() if losses else torch.zeros(())
    dist.all_reduce(loss, group=group)  # the last stage's loss on both
    grads = {n: p.grad.clone() for n, p in stage_model.named_parameters()}
    return loss.item(), grads


def _context_parallel(model: LlamaForCausalLM, rank: int, group) -> tuple[float, dict]:
    """Each worker its chunks; the global mean loss as the sum of the workers' token sums over
    all tokens; gradients summed over the group (what the strategies' all-reduce does)."""
    apply_context_parallel(model, group, rank, 2)
    inputs, targets = (shard_sequence(t, 1, rank, 2) for t in _batch())
    logits = model(inputs)
    local_sum = cross_entropy(logits, targets) * targets.numel()
    (local_sum / (BATCH * SEQ)).backward()
    total = local_sum.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)
        grads[name] = p.grad.clone()
    # The whole sequence's logits back together, to compare positions as well.
    whole = gather_sequence(logits.detach(), 1, group)
    return (total / (BATCH * SEQ)).item(), grads | {"__logits__": whole}


def _work(rank: int, world: int) -> dict:
    """The plain model's loss and gradients, then each split's errors against them."""
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    reference = copy.deepcopy(model)
    loss, grads = _plain(reference)
    with torch.no_grad():
        logits = reference(_batch()[0])
    results = {}
    for name, split in (("pp2", _pipeline), ("cp2", _context_parallel)):
        got_loss, got = split(copy.deepcopy(model), rank, group)
        got_logits = got.pop("__logits__", None)
        assert got.keys() <= grads.keys() and got, (name, sorted(got))
        results[name] = {
            "loss": abs(got_loss - loss),
            "grads": max((got[k] - grads[k]).abs().max().item() for k in got),
            "params": sorted(got),
            "largest_grad": max(grads[k].abs().max().item() for k in got),
        }
        if got_logits is not None:
            results[name]["logits"] = (got_logits - logits).abs().max().item()
    return results


TWO_PROCESS_CHECKS = {"splits": _work}


@pytest.fixture(scope="module")
def split_errors(two_processes) -> list[dict]:
    return two_processes(__name__, "splits")


def test_pipeline_stages_of_the_llama_equal_the_plain_model(split_errors):
    for rank, errors in enumerate(split_errors):
        measured = errors["pp2"]
        print(f"pp2, rank {rank}: {measured['loss']:.2e} loss, {measured['grads']:.2e} grads")
        # Each stage holds its own blocks: the embedding with 0-1, the norm and head with 2-3.
        blocks = {name.split(".")[1] for name in measured["params"] if name.startswith("blocks")}
        assert blocks == ({"0", "1"} if rank == 0 else {"2", "3"})
        assert any(n.startswith("tok_emb") for n in measured["params"]) == (rank == 0)
        assert any(n.startswith("head") for n in measured["params"]) == (rank == 1)
        assert measured["loss"] <= LOSS_ATOL, measured
        assert measured["grads"] <= GRAD_ATOL < measured["largest_grad"] / 1000, measured


def test_context_parallel_llama_equals_the_plain_model(split_errors):
    for rank, errors in enumerate(split_errors):
        measured = errors["cp2"]
        print(f"cp2, rank {rank}: {measured['logits']:.2e} logits, {measured['grads']:.2e} grads")
        assert len(measured["params"]) == len(split_errors[0]["cp2"]["params"])
        assert measured["logits"] <= LOSS_ATOL, measured  # positions by global index
        assert measured["loss"] <= LOSS_ATOL, measured
        assert measured["grads"] <= GRAD_ATOL < measured["largest_grad"] / 1000, measured
