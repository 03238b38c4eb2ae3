"""What each layout keeps on one worker, and what it costs in throughput, measured side by side.

One model (the byte-level GPT of configs/train/lm_pipeline.yaml, widened with `--d-model`), one
data set, the same global batch and steps for every layout, on 2 and 4 Ray Train workers
(fractional CPUs, one torch thread each): ddp, fsdp, tp (and fsdp x tp at 4), pipeline (and
hybrid at 4). For each: the largest worker's parameter, gradient and optimizer-state bytes and
activation peak, as every run records them (`worker_*_mb`), and the group's training throughput
in the last epoch (the first pays one-time start-up).

Prints a table and ends with one JSON line: `fsdp_state_ratio` (fsdp's per-worker parameter +
gradient + optimizer bytes over ddp's, 2 workers), `tp_state_ratio` (the same for tp=2),
`fsdp_vs_ddp_throughput` (2 workers), and the 4-worker ratios.

    python benchmarks/memory_layouts.py [--d-model 128] [--steps 8] [--smoke]

`--smoke` runs ddp and fsdp on 2 workers only (the other ratios are null), one epoch of one
step of a d_model 16 GPT.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness import add_smoke_flag, print_last_line, ray_session

from raylane.config import load_config
from raylane.config.layout import replicas
from raylane.data import ensure_dataset
from raylane.data.ray_datasets import read_datasets
from raylane.train.trainer import build_trainer

ROOT = Path(__file__).resolve().parents[1]
STATE = ("param", "grad", "optimizer_state")

LAYOUTS = {
    2: {
        "ddp": ["parallelism.strategy=ddp"],
        "fsdp": ["parallelism.strategy=fsdp", "parallelism.tp=1"],
        "tp": ["parallelism.strategy=tp", "parallelism.tp=2"],
        "pipeline": ["parallelism.strategy=pipeline", "parallelism.pp=2"],
    },
    4: {
        "ddp": ["parallelism.strategy=ddp"],
        "fsdp": ["parallelism.strategy=fsdp", "parallelism.tp=1"],
        "tp": ["parallelism.strategy=tp", "parallelism.tp=2"],
        "fsdp x tp": ["parallelism.strategy=fsdp", "parallelism.tp=2"],
        "pipeline": ["parallelism.strategy=pipeline", "parallelism.pp=4"],
        "hybrid": ["parallelism.strategy=hybrid", "parallelism.pp=2", "parallelism.dp=2"],
    },
}
SMOKE_LAYOUTS = {2: {name: LAYOUTS[2][name] for name in ("ddp", "fsdp")}}


def bench_config(workdir: Path, args, workers: int, overrides: list[str]):
    """The same global batch (`--batch` rows) for every layout: per replica, batch / replicas."""
    base = [
        f"data.train_path={workdir}/data/train.parquet",
        f"data.validation_path={workdir}/data/validation.parquet",
        f"training.storage_path={workdir}/runs",
        f"training.epochs={args.epochs}",
        f"training.steps_per_epoch={args.steps}",
        f"model.d_model={args.d_model}",
        "model.n_layers=4",
        f"parallelism.workers={workers}",
        "parallelism.strategy=ddp",
        "parallelism.pp=1",
        "parallelism.dp=1",
        "parallelism.microbatches=4",
        "parallelism.torch_threads=1",
        f"parallelism.resources_per_worker.CPU={2 / workers}",
    ]
    cfg = load_config(ROOT / "configs" / "train" / "lm_pipeline.yaml", [*base, *overrides])
    per_replica = args.batch // replicas(cfg)
    return load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        [*base, *overrides, f"training.batch_size={per_replica}"],
    )


def train(cfg, name: str) -> dict:
    """The last epoch's metrics of one run (Ray Train + Ray Data, no MLflow run)."""
    result = build_trainer(cfg, read_datasets(cfg), name).fit()
    return max((m for _, m in result.best_checkpoints), key=lambda m: m["epoch"])


def state_mb(metrics: dict) -> float:
    return sum(metrics[f"worker_{part}_mb"] for part in STATE)


def run_all(args) -> dict[tuple[int, str], dict]:
    """Every layout at 2 and 4 workers on one local Ray: the last epoch's metrics of each."""
    layouts = SMOKE_LAYOUTS if args.smoke else LAYOUTS
    results: dict[tuple[int, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ensure_dataset(bench_config(workdir, args, 2, []))
        stamp = time.strftime("%H%M%S")
        with ray_session(num_cpus=2):
            for workers, group in layouts.items():
                for name, overrides in group.items():
                    print(f"{workers} workers, {name} ...", flush=True)
                    cfg = bench_config(workdir, args, workers, overrides)
                    slug = name.replace(" ", "")
                    results[workers, name] = train(cfg, f"mem-{workers}-{slug}-{stamp}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per epoch")
    parser.add_argument("--batch", type=int, default=32, help="global batch (rows per step)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.epochs = 2  # the last epoch's figures: the first pays one-time start-up
    if args.smoke:
        args.epochs, args.steps, args.batch, args.d_model = 1, 1, 4, 16
    results = run_all(args)
    print(f"\nper-worker memory (largest worker, MB), d_model {args.d_model}, 4 blocks")
    print(
        f"{'workers':>7} {'layout':<10} {'params':>8} {'grads':>8} {'optim':>8} {'state':>8} "
        f"{'vs ddp':>7} {'activ.':>8} {'rows/s':>8} {'vs ddp':>7}"
    )
    for (workers, name), m in results.items():
        ddp = results[workers, "ddp"]
        print(
            f"{workers:>7} {name:<10} {m['worker_param_mb']:>8.2f} {m['worker_grad_mb']:>8.2f} "
            f"{m['worker_optimizer_state_mb']:>8.2f} {state_mb(m):>8.2f} "
            f"{state_mb(m) / state_mb(ddp):>7.3f} {m['worker_activation_peak_mb']:>8.2f} "
            f"{m['train_samples_per_s']:>8.1f} "
            f"{m['train_samples_per_s'] / ddp['train_samples_per_s']:>7.3f}"
        )

    def ratio(workers: int, name: str, key=state_mb) -> float | None:
        if (workers, name) not in results:
            return None  # not run (--smoke)
        return round(key(results[workers, name]) / key(results[workers, "ddp"]), 4)

    def throughput(m: dict) -> float:
        return m["train_samples_per_s"]

    print_last_line(
        {
            "fsdp_state_ratio": ratio(2, "fsdp"),
            "tp_state_ratio": ratio(2, "tp"),
            "pipeline_state_ratio": ratio(2, "pipeline"),
            "fsdp_vs_ddp_throughput": ratio(2, "fsdp", throughput),
            "tp_vs_ddp_throughput": ratio(2, "tp", throughput),
            "fsdp4_state_ratio": ratio(4, "fsdp"),
            "fsdp_tp4_state_ratio": ratio(4, "fsdp x tp"),
            "d_model": args.d_model,
            "global_batch": args.batch,
        },
        args.smoke,
    )


if __name__ == "__main__":
    main()
