"""The links a profile measures: an all-reduce over each level's workers and a point-to-point
exchange between ranks 0 and 1, at sizes from 4 KiB to 4 MiB, fitted by `raylane.plan.fits`
as alpha + beta * bytes. The tensors live on the process group's device (the GPU under NCCL,
which has no CPU backend) and `median_s` synchronises it before reading the clock."""

from __future__ import annotations

from raylane.parallel.device import collective_device

SIZES = tuple(4**k * 1024 for k in range(1, 7))  # 4 KiB .. 4 MiB


def time_all_reduce(group, median_s) -> dict[int, float]:
    """Seconds of an all-reduce over `group` at each of `SIZES` (bytes), on its device."""
    import torch
    import torch.distributed as dist

    found = {}
    for size in SIZES:
        tensor = torch.zeros(size // 4, device=collective_device(group))

        def reduce(tensor=tensor):
            dist.all_reduce(tensor, group=group)

        found[size] = median_s(reduce)
    return found


def time_p2p(rank: int, median_s) -> dict[int, float]:
    """Seconds of a one-way transfer between ranks 0 and 1 at each of `SIZES` (half a round
    trip), on the default group's device; collective (the other ranks wait at barriers)."""
    import torch
    import torch.distributed as dist

    found = {}
    for size in SIZES:
        tensor = torch.zeros(size // 4, device=collective_device())

        def exchange(tensor=tensor):
            # One round trip between ranks 0 and 1; the others wait at the next barrier.
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            elif rank == 1:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)

        dist.barrier()
        found[size] = median_s(exchange) / 2
    return found
