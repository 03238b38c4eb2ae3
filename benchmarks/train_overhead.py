"""What Ray Train + Ray Data cost against a bare torch loop, and what a second worker buys.

Measured side by side in one run, on the digits data and a convolutional digits model (widened
so a step is compute-bound), one torch thread per process:

  (a) a bare single-process torch loop over in-memory tensors;
  (b) Ray Train, 1 worker, fed by Ray Data from Parquet;
  (c) Ray Train, 2 workers (DDP), fed by Ray Data;
  (d) plain torch DDP, two processes (torch.multiprocessing, gloo), each on its half of the
      in-memory tensors: the same model, batch size and threads without Ray.

(b) and (c) also report their step-time split (raylane.tracking.step_times): data wait, compute
and exposed communication per step, which says where Ray's extra time over (d) goes.

Start-up is excluded: each figure is the median of per-epoch samples/s after the first
(warm-up) epoch. The training split is repeated `--repeat` times (default 6, about 8,600 rows)
so an epoch lasts seconds and Ray Data's fixed per-epoch start (tens of milliseconds) is
amortised as it is on real datasets. The last line printed is one JSON object with the ratios.

    python benchmarks/train_overhead.py [--epochs 5] [--batch-size 128] [--repeat 6] [--smoke]

`--smoke` runs (a), (c) and (d) for 2 epochs on the split once with a 4-channel CNN, (c) at 2
steps per epoch; (b) is left out and its figures are null.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from harness import add_smoke_flag, print_last_line, ray_session

from raylane.config import load_config
from raylane.data import ensure_dataset
from raylane.data.ray_datasets import read_datasets
from raylane.models import build_model
from raylane.train.trainer import build_trainer

ROOT = Path(__file__).resolve().parents[1]


def bench_config(workdir: Path, args, workers: int, steps: int | None = None):
    epochs, batch_size, channels = args.epochs, args.batch_size, args.channels
    return load_config(
        ROOT / "configs" / "train" / "digits_ddp.yaml",
        [
            f"data.train_path={workdir}/data/train.parquet",
            f"data.validation_path={workdir}/data/validation.parquet",
            f"training.storage_path={workdir}/runs",
            f"training.epochs={epochs}",
            f"training.batch_size={batch_size}",
            f"training.checkpoints_to_keep={epochs}",
            "model.kind=cnn",
            f"model.hidden_sizes={channels}",
            f"parallelism.workers={workers}",
            "parallelism.torch_threads=1",
            *([f"training.steps_per_epoch={steps}"] if steps else []),
        ],
    )


def repeat_training_rows(cfg, times: int) -> int:
    """Rewrite the training split with every row `times` times (same rows for every setup)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(cfg.data.train_path)
    pq.write_table(pa.concat_tables([table] * times), cfg.data.train_path)
    return table.num_rows * times


def _tensors(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    import pyarrow.parquet as pq

    table = pq.read_table(cfg.data.train_path)
    features = torch.from_numpy(
        np.stack(table.column("features").to_numpy(zero_copy_only=False)).astype(np.float32)
    )
    return features, torch.from_numpy(table.column("label").to_numpy().astype(np.int64))


def bare_torch(cfg) -> list[float]:
    """(a): the same model, optimizer, batch size and data, no Ray, one process."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.training.seed)
    features, labels = _tensors(cfg)
    model = build_model(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    rates = []
    for _ in range(cfg.training.epochs):
        start = time.perf_counter()
        order = torch.randperm(len(labels))
        for begin in range(0, len(labels), cfg.training.batch_size):
            index = order[begin : begin + cfg.training.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(features[index]), labels[index]).backward()
            optimizer.step()
        rates.append(len(labels) / (time.perf_counter() - start))
    return rates


def _ddp_worker(rank: int, cfg, port: int, rates) -> None:
    """One process of (d): DDP over gloo on every other batch of the shuffled rows."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(cfg.training.seed)
        features, labels = _tensors(cfg)
        model = DistributedDataParallel(build_model(cfg.model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr)
        loss_fn = torch.nn.CrossEntropyLoss()
        batch = cfg.training.batch_size
        mine = []
        for epoch in range(cfg.training.epochs):
            generator = torch.Generator().manual_seed(epoch)
            order = torch.randperm(len(labels), generator=generator)
            steps = len(labels) // (2 * batch)
            dist.barrier()
            start = time.perf_counter()
            for step in range(steps):
                index = order[(2 * step + rank) * batch : (2 * step + rank + 1) * batch]
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(features[index]), labels[index]).backward()
                optimizer.step()
            mine.append(2 * steps * batch / (time.perf_counter() - start))
        rates[rank] = mine
    finally:
        dist.destroy_process_group()


def plain_ddp(cfg) -> list[float]:
    """(d): per-epoch samples/s of the two-process group (rank 0's clock)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rates = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(cfg, port, rates), nprocs=2, join=True)
    return list(rates[0])


def ray_train(cfg, name: str) -> tuple[list[float], dict[str, float]]:
    """(b)/(c): the raylane trainer with Ray Data ingest; per-epoch samples/s from its reports,
    and the last epoch's step-time split."""
    result = build_trainer(cfg, read_datasets(cfg), name).fit()
    history = sorted((m for _, m in result.best_checkpoints), key=lambda m: m["epoch"])
    split = {k: v for k, v in history[-1].items() if k.startswith("step_")}
    return [m["train_samples_per_s"] for m in history], split


def steady(rates: list[float] | None) -> float | None:
    return statistics.median(rates[1:]) if rates else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def measure(args) -> tuple[int, dict, dict]:
    """Rows per epoch; each setup's per-epoch samples/s, each Ray run's step-time split."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        cfg1 = bench_config(workdir, args, 1)
        cfg2 = bench_config(workdir, args, 2, steps=2 if args.smoke else None)
        ensure_dataset(cfg1)
        rows = repeat_training_rows(cfg1, args.repeat)
        rates, splits = {}, {}
        with ray_session(num_cpus=2):
            stamp = time.strftime("%H%M%S")
            if not args.smoke:
                rates["ray1"], splits["ray1"] = ray_train(cfg1, f"bench-ray1-{stamp}")
            rates["ray2"], splits["ray2"] = ray_train(cfg2, f"bench-ray2-{stamp}")
        # The bare loop and plain DDP run with Ray stopped, as a user's script would.
        rates["bare"] = bare_torch(cfg1)
        rates["ddp2"] = plain_ddp(cfg2)
    return rows, rates, splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="Rows per step per worker.")
    parser.add_argument("--repeat", type=int, default=6, help="Copies of the training split.")
    parser.add_argument("--channels", default="[64, 128, 128]", help="CNN channels per layer.")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.repeat, args.channels = 2, 1, "[4, 4, 4]"
    rows, rates, splits = measure(args)
    bare, ray1, ray2, ddp2 = (rates.get(k) for k in ("bare", "ray1", "ray2", "ddp2"))
    split1, split2 = splits.get("ray1", {}), splits["ray2"]
    setups = [("(a) bare torch, 1 process", bare), ("(b) Ray Train, 1 worker", ray1),
            ("(c) Ray Train, 2 workers", ray2), ("(d) plain DDP, 2 processes", ddp2)]  # fmt: skip
    print(f"{'setup':<28} {'steady samples/s':>17}   per-epoch samples/s")
    print(f"training rows per epoch: {rows}")
    for label, found in setups:
        if found:
            print(f"{label:<28} {steady(found):>17.0f}   " + " ".join(f"{r:.0f}" for r in found))
    print("\nstep-time split, last epoch, ms per step (mean over workers):")
    for label, split in (("(b) Ray Train, 1 worker", split1), ("(c) Ray Train, 2 workers", split2)):
        if not split:
            continue
        parts = ", ".join(
            f"{k[5:-3]} {v:.2f}" for k, v in split.items() if k.endswith("_ms") and k != "step_ms"
        )
        print(f"{label:<28} step {split['step_ms']:.2f}: {parts}")
    figures = {
        "model": f"cnn {args.channels}",
        "batch_size_per_worker": args.batch_size,
        "epochs": args.epochs,
        "rows_per_epoch": rows,
        "torch_samples_per_s": rounded(steady(bare)),
        "ray1_samples_per_s": rounded(steady(ray1)),
        "ray2_samples_per_s": rounded(steady(ray2)),
        "ray1_vs_torch": ratio(steady(ray1), steady(bare)),
        "ray2_vs_ray1": ratio(steady(ray2), steady(ray1)),
        "ddp2_samples_per_s": rounded(steady(ddp2)),
        "ddp2_vs_torch": ratio(steady(ddp2), steady(bare)),
        "ray2_vs_ddp2": ratio(steady(ray2), steady(ddp2)),
        "ray2_comm_ms": round(split2.get("step_comm_ms", 0.0), 3),
        "ray2_data_wait_ms": round(split2.get("step_data_wait_ms", 0.0), 3),
    }
    print_last_line(figures, args.smoke)


if __name__ == "__main__":
    main()
