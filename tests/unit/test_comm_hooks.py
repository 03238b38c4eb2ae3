"""Bytes on the wire, counted by the communication hooks themselves, on real DDP over gloo.

One process suffices for what each worker hands to its collectives (the count does not depend
on the peers); a two-process group checks that top-k's sparse parts are summed across workers.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylane.parallel.grad_compression import register_compression


@pytest.fixture(scope="module")
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 10))


def _train(model: nn.Module, steps: int) -> None:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _bytes_per_step(method: str, steps: int = 6, warmup: int = 2) -> tuple[float, float]:
    model = DistributedDataParallel(_wide())
    meter = register_compression(model, method, topk_ratio=0.01)
    _train(model, warmup)  # DDP rebuilds buckets; PowerSGD starts after 2 steps
    meter.sent_bytes = meter.dense_bytes = 0
    _train(model, steps)
    return meter.sent_bytes / steps, meter.dense_bytes / steps


def test_fp32_sends_every_gradient_byte(process_group):
    sent, dense = _bytes_per_step("none")
    params = sum(p.numel() for p in _wide().parameters())
    assert sent == dense == params * 4


def test_compressed_schemes_send_their_share_of_the_fp32_bytes(process_group):
    fp32, _ = _bytes_per_step("none")
    fp16, _ = _bytes_per_step("fp16")
    powersgd, _ = _bytes_per_step("powersgd")
    topk, _ = _bytes_per_step("topk")
    assert fp16 / fp32 == 0.5
    assert 0 < powersgd / fp32 < 0.1, powersgd / fp32  # rank-1 factors plus the biases in full
    assert 0.015 < topk / fp32 < 0.025, topk / fp32  # 1 % of entries, value + int32 index each


def test_the_last_bucket_marks_when_backward_compute_ended(process_group):
    model = DistributedDataParallel(_wide())
    meter = register_compression(model, "none")
    _train(model, 1)
    assert meter.take_last_ready() is not None
    assert meter.take_last_ready() is None  # taken once per step


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _topk_worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = DistributedDataParallel(nn.Linear(100, 1, bias=False))
        register_compression(model, "topk", topk_ratio=0.02)  # 2 of 100 entries per worker
        with torch.no_grad():
            model.module.weight.zero_()
        # Each worker's gradient is large only on its own two entries.
        x = torch.zeros(1, 100)
        x[0, rank * 2 : rank * 2 + 2] = 10.0
        x[0, 50:] = 0.1 * (rank + 1)
        model(x).sum().backward()
        first = model.module.weight.grad.clone()
        model.zero_grad()
        model(torch.zeros(1, 100)).sum().backward()  # zero gradient: only fed-back error
        results[rank] = (first, model.module.weight.grad.clone())
    finally:
        dist.destroy_process_group()


def test_topk_sums_the_workers_sparse_parts_and_feeds_back_the_rest():
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_topk_worker, args=(_free_port(), results), nprocs=2, join=True)
    first, second = results[0][0][0], results[0][1][0]
    assert torch.equal(first, results[1][0][0])  # both workers apply the same gradient
    expected = torch.zeros(100)
    expected[:4] = 5.0  # each worker's 10.0 entries, averaged over 2 workers
    assert torch.equal(first, expected)
    # Step 2 sends the largest left-out entries (0.1 and 0.2 at positions 50+), not zeros.
    assert (second[50:] > 0).sum() >= 2 and second[:50].abs().sum() == 0
