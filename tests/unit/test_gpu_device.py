"""Tensors are made where the other side of their operation is: the worker's device for the
model, the process group's device for collectives (NCCL has no CPU backend), and the loop's
sums stay on the device until one read-back an epoch, with the numbers CPU runs always had."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raylane.models.losses import cross_entropy, token_sums
from raylane.parallel import device as placement
from raylane.parallel.device import (
    CPU,
    StreamClock,
    all_reduce_scalars,
    collective_device,
    to_device,
    worker_device,
)
from raylane.parallel.meters import ActivationMeter, worker_memory


@pytest.fixture
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_cpu_worker_computes_on_the_cpu_and_collectives_without_a_group_too():
    assert worker_device(use_gpu=False) == CPU
    assert collective_device() == CPU


def test_gloo_reduces_on_the_cpu_and_nccl_on_the_current_gpu(process_group, monkeypatch):
    assert collective_device() == CPU
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)


def test_every_collective_of_the_loop_takes_a_tensor_of_the_groups_device(
    process_group, monkeypatch
):
    """The class of bug NCCL stops on: a reduction whose tensor was made on another device
    than the group's. Pretend the group's device is 'meta' and check what reaches it."""
    seen = []

    def all_reduce(tensor, op=None, group=None):
        seen.append(tensor.device)

    monkeypatch.setattr(placement, "collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(NotImplementedError):  # 'meta' holds no values to read back
        all_reduce_scalars([1.0, torch.tensor(2.0, dtype=torch.float64)])
    assert seen == [torch.device("meta")]


def test_scalars_reduce_as_host_floats_would(process_group):
    losses = [torch.tensor(v, dtype=torch.float32) for v in (2.3456789, 0.1234567, 7.654321)]
    shares = [3.0, 5.0, 0.5]
    on_device = 0.25
    on_host = 0.25
    for loss, share in zip(losses, shares, strict=True):
        on_device = on_device + loss.double() * share  # the loop's sum, kept as a tensor
        on_host += loss.item() * share  # what the loop summed before
    total, rows, peak = all_reduce_scalars([on_device, 8.5, torch.tensor([7], dtype=torch.int64)])
    assert total == on_host  # the same float64 arithmetic, bit for bit
    assert (rows, peak) == (8.5, 7.0)
    assert all_reduce_scalars([]) == []


def test_a_vocabulary_split_loss_reaches_the_epoch_sums_as_a_plain_tensor(process_group):
    """Under sequence parallelism the loss comes from `loss_parallel` as a replicated DTensor;
    summed into the loop's totals it made the epoch's all-reduce refuse the DTensor (and the
    other ranks wait in theirs). The step hands the loop a plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from raylane.parallel.base import StrategyDefaults

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def replicated_loss(outputs, targets):
        loss = torch.nn.functional.cross_entropy(outputs, targets)
        return DTensor.from_local(loss, mesh, [Replicate()])

    strategy = StrategyDefaults()
    strategy.last_step_parts = {}
    inputs, targets = torch.ones(2, 4), torch.tensor([0, 2])
    loss = strategy.train_step(model, optimizer, replicated_loss, inputs, targets)
    assert not isinstance(loss, DTensor)
    total = 0.0 + loss.double() * 2
    with pytest.raises(NotImplementedError, match="sharding strategy"):  # what it did before
        all_reduce_scalars([0.0 + DTensor.from_local(loss, mesh, [Replicate()]).double()])
    assert all_reduce_scalars([total]) == [pytest.approx(float(loss) * 2)]


def test_a_host_tensor_reaches_the_cpu_unchanged():
    tensor = torch.arange(4)
    assert to_device(tensor, "cpu") is tensor


def test_a_host_tensor_bound_for_a_gpu_is_copied_from_pinned_memory_without_blocking(
    monkeypatch,
):
    calls = []

    class Pinned:
        def to(self, device, non_blocking=False):
            calls.append((device, non_blocking))
            return "copied"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: Pinned())
    assert to_device(torch.zeros(2), "cuda:1") == "copied"
    assert calls == [(torch.device("cuda", 1), True)]


def test_a_cpu_worker_reports_no_device_peak_and_its_clock_is_the_hosts():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = worker_memory(model, optimizer, ActivationMeter(), CPU)
    assert set(memory) == {"param", "grad", "optimizer_state", "activation_peak"}
    clock = StreamClock(CPU)
    start = clock.mark()
    assert clock.seconds(start, clock.mark()) >= 0.0


def test_evaluation_keeps_its_sums_on_the_device_with_the_numbers_of_host_sums(monkeypatch):
    """`_evaluate` sums on the outputs' device and reads back once; its figures are those of
    the per-batch `.item()` sums it replaced."""
    from raylane.train import loop

    torch.manual_seed(0)
    batches = [(torch.randn(n, 8), torch.randint(0, 5, (n,))) for n in (7, 4, 9)]
    model = torch.nn.Linear(8, 5)

    class Strategy:  # a whole-logits evaluation, as a strategy that fuses no loss runs it
        def validation_sums(self, model, inputs, targets):
            return token_sums(model(inputs).float(), targets)

    monkeypatch.setattr(loop, "_my_batches", lambda *args, **kwargs: iter(batches))
    loss, accuracy = loop._evaluate(Strategy(), model, None, None)
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for inputs, targets in batches:
            outputs = model(inputs)
            loss_sum += cross_entropy(outputs, targets).item() * targets.numel()
            correct += (outputs.argmax(dim=-1) == targets).sum().item()
            count += targets.numel()
    assert (loss, accuracy) == (loss_sum / count, correct / count)
