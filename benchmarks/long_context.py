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

    python benchmarks/long_context.py [--steps 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

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


def _worker(rank: int, world: int, port: int, job: dict, results) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
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
    peaks = [None] * world
    dist.all_gather_object(peaks, meter.peak_bytes)
    if rank == 0:
        step = statistics.median(seconds[1:])
        results.put({**job, "peak_bytes": max(peaks), "tokens_per_s": BATCH * length / step})
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads stopped before the process exits


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


def run(job: dict, world: int) -> dict:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), job, results), nprocs=world)
    return results.get()


def _max_length(rows: list[dict], budget: float) -> float:
    """The longest T whose activations fit `budget`, from the bytes per token measured at the
    longest T (activations grow linearly in T with a blockwise attention)."""
    longest = max(rows, key=lambda r: r["length"])
    return budget / (longest["peak_bytes"] / longest["length"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="Steps per configuration.")
    args = parser.parse_args()
    cp = {(w, t): run({"kind": "cp", "length": t, "steps": args.steps}, w)
          for w in WORLDS for t in LENGTHS}  # fmt: skip
    sp = {flag: run({"kind": "tp", "length": 1024, "steps": args.steps,
                     "sequence_parallel": flag}, 2) for flag in (False, True)}  # fmt: skip
    print(f"{'T':>6} {'cp':>3} {'activation MB':>14} {'ideal 1/cp MB':>14} {'tokens/s':>9}")
    for (world, length), row in sorted(cp.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ideal = cp[(1, length)]["peak_bytes"] / world / 2**20
        print(f"{length:>6} {world:>3} {row['peak_bytes'] / 2**20:>14.2f} {ideal:>14.2f} "
              f"{row['tokens_per_s']:>9.0f}")  # fmt: skip
    for flag, row in sp.items():
        print(f"T 1024, tp 2, sequence parallel {flag}: {row['peak_bytes'] / 2**20:.2f} MB per "
              f"worker, {row['tokens_per_s']:.0f} tokens/s")  # fmt: skip
    budget = cp[(1, 2048)]["peak_bytes"]
    longest = {w: _max_length([cp[(w, t)] for t in LENGTHS], budget) for w in WORLDS}
    figures = {
        "cp2_activation_ratio": round(cp[(2, 4096)]["peak_bytes"] / cp[(1, 4096)]["peak_bytes"], 3),
        "cp4_activation_ratio": round(cp[(4, 4096)]["peak_bytes"] / cp[(1, 4096)]["peak_bytes"], 3),
        "sp_activation_ratio": round(sp[True]["peak_bytes"] / sp[False]["peak_bytes"], 3),
        "cp_tokens_per_s_ratio": round(
            cp[(2, 4096)]["tokens_per_s"] / cp[(1, 4096)]["tokens_per_s"], 3
        ),
        "max_len_gain": round(longest[4] / longest[1], 2),
        "max_len_at_budget": {f"cp{w}": round(v) for w, v in longest.items()},
        "peak_mb": {f"cp{w}_T{t}": round(r["peak_bytes"] / 2**20, 2) for (w, t), r in cp.items()},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
