"""Ring attention (raylane.parallel.ring_attention) against SDPA on the whole sequence: outputs
and gradients of 2- and 4-process gloo rings, the zig-zag chunking helpers and the traffic."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from raylane.parallel.ring_attention import (
    RingTraffic,
    gather_sequence,
    positions_for,
    ring_attention,
    ring_traffic,
    shard_sequence,
    unshard_sequence,
)

from .gloo import on_gloo

SHAPE = (2, 2, 64, 8)  # batch, heads, whole sequence, head_dim
SEQ = 2
ATOL = 1e-5


def _inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient of the whole sequence; the same on every process."""
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(SHAPE, generator=generator) for _ in range(4))


def _full_attention() -> dict[str, torch.Tensor]:
    q, k, v, grad = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_inputs()))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _run_ring(group, rank: int, world: int) -> dict:
    q, k, v, grad = (shard_sequence(t, SEQ, rank, world) for t in _inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    traffic = RingTraffic()
    out = ring_attention(q, k, v, group, traffic=traffic)
    out.backward(grad)
    return {
        "out": out.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "gathered": gather_sequence(out.detach(), SEQ, group),
        "traffic": (traffic.forward_bytes, traffic.backward_bytes, traffic.transfers),
        "waited_s": traffic.wait_s,
    }


def _rings(rank: int, world: int) -> dict:
    """A 4-rank ring over the default group, then 2-rank rings over the pairs (0, 1) and
    (2, 3) (the second one's group ranks are not its global ranks)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return {4: _run_ring(None, rank, 4), 2: _run_ring(pairs[rank // 2], rank % 2, 2)}


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> list[dict]:
    """Every process's results, in rank order; one spawn (each process imports torch) for
    both ring sizes keeps the test quick."""
    return on_gloo(_rings, 4, tmp_path_factory.mktemp("ring"))


def _max_errors(parts: list[dict], full: dict) -> dict[str, float]:
    return {
        name: (unshard_sequence([part[name] for part in parts], SEQ) - full[name])
        .abs()
        .max()
        .item()
        for name in ("out", "dq", "dk", "dv")
    }


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_causal_sdpa_on_the_whole_sequence(world, ring_results):
    full = _full_attention()
    rings = [
        [result[world] for result in ring_results[start : start + world]]
        for start in range(0, 4, world)
    ]
    for parts in rings:
        errors = _max_errors(parts, full)
        print(f"world {world}: max abs errors {errors}")
        assert all(error <= ATOL for error in errors.values()), errors
        for part in parts:
            assert (part["gathered"] - full["out"]).abs().max() <= ATOL
    local_k = shard_sequence(_inputs()[1], SEQ, 0, world)
    expected = ring_traffic(local_k, world)
    assert all(
        result[world]["traffic"]
        == (expected.forward_bytes, expected.backward_bytes, expected.transfers)
        for result in ring_results
    )
    assert all(result[world]["waited_s"] > 0 for result in ring_results)  # timed waits
    # Forward: N-1 k/v blocks of 2 * 2 * 2 * (64 / N) * 8 fp32 values each.
    assert expected.forward_bytes == (world - 1) * 2 * 2 * 2 * (64 // world) * 8 * 4


def test_one_rank_is_plain_causal_attention_without_communication():
    full = _full_attention()
    q, k, v, grad = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_inputs()))
    traffic = RingTraffic()
    out = ring_attention(q, k, v, traffic=traffic)
    out.backward(grad)
    for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert (got - full[name]).abs().max() <= ATOL, name
    assert traffic.total_bytes == 0 and ring_traffic(k, 1).total_bytes == 0
    assert traffic.wait_s == 0.0  # nothing to wait for


def test_custom_scale_matches_sdpa():
    q, k, v, _ = _inputs()
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    assert (ring_attention(q, k, v, scale=0.5) - expected).abs().max() <= ATOL


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zigzag_shards_round_trip_and_give_each_rank_its_positions(world):
    length = 16
    tokens = torch.arange(length).repeat(3, 1)  # [batch, seq]
    parts = [shard_sequence(tokens, 1, rank, world) for rank in range(world)]
    assert torch.equal(unshard_sequence(parts, 1), tokens)
    chunk = length // (2 * world)
    for rank, part in enumerate(parts):
        positions = positions_for(length, rank, world)
        assert torch.equal(part[0], positions)
        assert positions[0] == rank * chunk and positions[-1] == (2 * world - rank) * chunk - 1


def test_zigzag_gives_every_rank_the_same_causal_work():
    length, world = 64, 4
    work = [sum(int(p) + 1 for p in positions_for(length, rank, world)) for rank in range(world)]
    assert len(set(work)) == 1


def test_sequence_length_must_split_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_sequence(torch.zeros(1, 12), 1, 0, 4)
    with pytest.raises(ValueError, match="even"):
        ring_attention(*(torch.zeros(1, 1, 3, 4) for _ in range(3)))


def test_under_bf16_autocast_it_computes_in_fp32_forward_and_backward():
    """A bf16 run's attention: the ring's own fp32 maths (autocast off inside), so the
    backward's recomputed probabilities match the forward's log-sum-exp."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=generator, requires_grad=True) for _ in "qkv")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(q, k, v)
    out.sum().backward()
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(reference.sum(), (q, k, v))
    for mine, want in zip((q.grad, k.grad, v.grad), grads, strict=True):
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-5)
