"""Long sequences: per-worker activation memory and speed with context and sequence parallelism.

The same GPT (d_model 64, 4 heads, 2 blocks) and the same global batch (2 sequences) at
T = 1,024, 2,048 and 4,096 bytes on 1, 2 and 4 workers splitting each sequence (context
parallelism: raylane's `apply_context_parallel`, ring attention over gloo), and at T = 1,024 on
2 tensor-parallel workers with and without sequence parallelism. Each configuration runs
`--steps` SGD steps (one warm-up) in fresh processes, one torch thread each; reported per
worker: the peak bytes of activations autograd holds for backward (raylane's `ActivationMeter`,
what the runs log as `worker_activation_peak_mb`), tokens/s (the batch's tokens over the
median step), and next to it the ideal 1 / cp of the single worker's activations.

The last line printed is one JSON object with `cp2_activation_ratio` and
`cp4_activation_ratio` (per-worker activation peak at cp = 2 and 4 over cp = 1, at T = 4,096;
targets <= 0.6 and <= 0.35), `sp_activation_ratio` (tp = 2 with sequence parallelism over
without; target <= 0.75), `cp_tokens_per_s_ratio` (cp = 2 over cp = 1 at T = 4,096, reported)
and `max_len_gain` (the longest T whose per-worker activations fit the budget that T = 2,048
takes on one worker, cp = 4 over cp = 1, from each cp's measured bytes per token; target >=
3.5). On 2 cores, 4 workers share them: their tokens/s says what the ring costs, not what 4
devices would give.

    python benchmarks/long_context.py [--steps 4] [--smoke]

`--smoke` runs T = 64 on 1 and 2 workers and the tp pair at T = 64, two steps each (the cp = 4
figures are null).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp
from harness import add_smoke_flag, print_last_line

from raylane.models.gpt import GPT
from raylane.parallel.meters import ActivationMeter
from raylane.parallel.parallelize import (
    apply_context_parallel,
    apply_tensor_parallel,
    sharded_loss,
)
from raylane.parallel.ring_attention import shard_sequence

LENGTHS = (1024, 2048, 4096)
WORLDS = (1, 2, 4)
BATCH = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs: list[dict], results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for job in jobs:
        peak_bytes, step = _job(job, rank, world)
        peaks = [None] * world
        dist.all_gather_object(peaks, peak_bytes)
        if rank == 0:
            tokens_per_s = BATCH * job["length"] / step
            results.put({**job, "peak_bytes": max(peaks), "tokens_per_s": tokens_per_s})
        dist.barrier()
    dist.destroy_process_group()  # gloo's threads stopped before the process exits


def _job(job: dict, rank: int, world: int) -> tuple[int, float]:
    """One configuration's steps on this worker: its activation peak and median step (s)."""
    import torch.nn.functional as F

    length = job["length"]
    torch.manual_seed(0)
    model = GPT(256, length, 64, 4, 2)
    inputs, targets = _setup(model, job, rank, world, length)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    meter, seconds = ActivationMeter(), []
    for _ in range(job["steps"]):
        started = time.perf_counter()
        optimizer.zero_grad()
        with _loss_scope(job):
            with meter:
                loss = F.cross_entropy(model(inputs).reshape(-1, 256), targets.reshape(-1))
            loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    return meter.peak_bytes, statistics.median(seconds[1:])


def _setup(model, job: dict, rank: int, world: int, length: int):
    """Parallelise `model` as `job` says; this worker's inputs and targets."""
    import torch.distributed as dist

    tokens = torch.randint(0, 256, (BATCH, length + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if job["kind"] == "cp" and world > 1:
        apply_context_parallel(model, dist.group.WORLD, rank, world)
        return shard_sequence(inputs, 1, rank, world), shard_sequence(targets, 1, rank, world)
    if job["kind"] == "tp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        sequence = job["sequence_parallel"]
        apply_tensor_parallel(model, mesh, sequence, vocabulary_loss=sequence)
    return inputs, targets


def _loss_scope(job: dict):
    """Sequence parallelism's vocabulary-split head: the loss under torch's `loss_parallel`,
    as raylane's training step runs it."""
    if job.get("sequence_parallel"):
        return sharded_loss()
    return contextlib.nullcontext()


def run(jobs: list[dict], world: int, here: bool = False) -> list[dict]:
    """`jobs` one after the other on one group of `world` fresh processes (`here`: a group of
    one, this process): their figures."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    if here:
        _worker(0, 1, _free_port(), jobs, results)
    else:
        mp.spawn(_worker, args=(world, _free_port(), jobs, results), nprocs=world)
    return [results.get() for _ in jobs]


def _max_length(rows: list[dict], budget: float) -> float:
    """The longest T whose activations fit `budget`, from the bytes per token measured at the
    longest T (activations grow linearly in T with a blockwise attention)."""
    longest = max(rows, key=lambda r: r["length"])
    return budget / (longest["peak_bytes"] / longest["length"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="Steps per configuration.")
    add_smoke_flag(parser)
    args = parser.parse_args()
    lengths, worlds = ((64,), (1, 2)) if args.smoke else (LENGTHS, WORLDS)
    steps = 2 if args.smoke else args.steps  # one warm-up, one measured
    sp_length = lengths[0]
    tp_jobs = [{"kind": "tp", "length": sp_length, "steps": steps, "sequence_parallel": flag}
               for flag in (False, True)]  # fmt: skip
    cp, sp = {}, {}
    for world in worlds:  # one group of processes per world size; the tp pair on 2
        jobs = [{"kind": "cp", "length": t, "steps": steps} for t in lengths]
        here = args.smoke and world == 1  # a smoke run spares a process start
        for row in run([*jobs, *(tp_jobs if world == 2 else [])], world, here):
            if row["kind"] == "cp":
                cp[world, row["length"]] = row
            else:
                sp[row["sequence_parallel"]] = row
    print(f"{'T':>6} {'cp':>3} {'activation MB':>14} {'ideal 1/cp MB':>14} {'tokens/s':>9}")
    for (world, length), row in sorted(cp.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ideal = cp[(1, length)]["peak_bytes"] / world / 2**20
        print(f"{length:>6} {world:>3} {row['peak_bytes'] / 2**20:>14.2f} {ideal:>14.2f} "
              f"{row['tokens_per_s']:>9.0f}")  # fmt: skip
    for flag, row in sp.items():
        print(f"T {sp_length}, tp 2, sequence parallel {flag}: {row['peak_bytes'] / 2**20:.2f} "
              f"MB per worker, {row['tokens_per_s']:.0f} tokens/s")  # fmt: skip
    print_last_line(figures_of(cp, sp, lengths, worlds), args.smoke)


def figures_of(cp: dict, sp: dict, lengths, worlds) -> dict:
    """The last line's figures; those of a cp or T that did not run are null."""
    longest_t, budget_t = lengths[-1], lengths[min(1, len(lengths) - 1)]
    budget = cp[(1, budget_t)]["peak_bytes"]
    longest = {w: _max_length([cp[(w, t)] for t in lengths], budget) for w in worlds}

    def at_longest(world: int, key: str) -> float | None:
        if world not in worlds:
            return None
        return round(cp[(world, longest_t)][key] / cp[(1, longest_t)][key], 3)

    return {
        "cp2_activation_ratio": at_longest(2, "peak_bytes"),
        "cp4_activation_ratio": at_longest(4, "peak_bytes"),
        "sp_activation_ratio": round(sp[True]["peak_bytes"] / sp[False]["peak_bytes"], 3),
        "cp_tokens_per_s_ratio": at_longest(2, "tokens_per_s"),
        "max_len_gain": round(longest[4] / longest[1], 2) if 4 in worlds else None,
        "max_len_at_budget": {f"cp{w}": round(v) for w, v in longest.items()},
        "peak_mb": {f"cp{w}_T{t}": round(r["peak_bytes"] / 2**20, 2) for (w, t), r in cp.items()},
    }


if __name__ == "__main__":
    main()
