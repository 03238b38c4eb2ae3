"""What gradient compression and relaxed consistency cost and save, measured side by side.

One model (the digits MLP of configs/train/digits_ddp.yaml), one data set, 2 Ray Train workers
on fractional CPUs, the same epoch budget for every setup, one torch thread per worker:

  (a) DDP with each gradient-communication scheme: fp32 ('none'), fp16, PowerSGD (rank 1),
      top-k (1 %): bytes each worker handed to collectives per step (counted in the hooks)
      against fp32's, and the final validation accuracy;
  (b) consistency models: sync (DDP all-reduce), async (parameter server on Ray actors),
      ssp (staleness 2), local_sgd (H = 4), without and with a straggler (the workers take
      turns sleeping `--delay` s every `--every` steps): training time to `--target`
      validation accuracy (epoch granularity, after the first epoch, which also pays one-time
      start-up) and the final accuracy.

Every run's step-time split is checked: `split_sum_error` is the worst |sum of the measured
parts - step| / step over all epochs of all runs. Prints a table, writes the convergence plot
(accuracy against training time per mode) to `--plot`, and ends with one JSON line.

    python benchmarks/consistency.py [--epochs 8] [--target 0.94] [--delay 0.1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from raylane.config import load_config
from raylane.data import ensure_dataset
from raylane.data.ray_datasets import read_datasets
from raylane.train.trainer import build_trainer

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ["none", "fp16", "powersgd", "topk"]
MODES = {
    "sync": ["parallelism.strategy=ddp"],
    "async": ["parallelism.strategy=async"],
    "ssp": ["parallelism.strategy=ssp", "parallelism.staleness=2"],
    "local_sgd": ["parallelism.strategy=local_sgd", "parallelism.local_sgd_period=4"],
}


def bench_config(workdir: Path, args, overrides: list[str]):
    return load_config(
        ROOT / "configs" / "train" / "digits_ddp.yaml",
        [
            f"data.train_path={workdir}/data/train.parquet",
            f"data.validation_path={workdir}/data/validation.parquet",
            f"training.storage_path={workdir}/runs",
            f"training.epochs={args.epochs}",
            f"training.checkpoints_to_keep={args.epochs}",
            f"model.hidden_sizes={args.hidden}",
            "parallelism.workers=2",
            "parallelism.torch_threads=1",
            *overrides,
        ],
    )


def train(cfg, name: str) -> list[dict]:
    """Per-epoch metrics of one run (Ray Train + Ray Data, no MLflow run)."""
    result = build_trainer(cfg, read_datasets(cfg), name).fit()
    return sorted((m for _, m in result.best_checkpoints), key=lambda m: m["epoch"])


def time_to(history: list[dict], target: float) -> float | None:
    """Training seconds after the first epoch (which also pays the one-time start of Ray
    Data's pipeline and of any parameter server) until the validation accuracy at the end of
    a later epoch first reaches `target`."""
    elapsed = 0.0
    for epoch in history[1:]:
        elapsed += epoch["epoch_time_s"]
        if epoch["val_accuracy"] >= target:
            return elapsed
    return None


def straggler(args) -> list[str]:
    return [
        "parallelism.straggler.rank=[0,1]",
        f"parallelism.straggler.every={args.every}",
        f"parallelism.straggler.delay_s={args.delay}",
    ]


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, history in curves.items():
        elapsed, times = 0.0, []
        for epoch in history[1:]:
            elapsed += epoch["epoch_time_s"]
            times.append(elapsed)
        axis.plot(times, [e["val_accuracy"] for e in history[1:]], marker="o", label=label)
    axis.set(
        xlabel="training time after the first epoch (s)",
        ylabel="validation accuracy",
        title="convergence",
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--hidden", default="[256,256]")
    parser.add_argument("--target", type=float, default=0.94)
    parser.add_argument("--every", type=int, default=4, help="straggler: steps between sleeps")
    parser.add_argument("--delay", type=float, default=0.1, help="straggler: seconds per sleep")
    parser.add_argument("--plot", type=Path, default=Path("consistency.png"))
    return parser.parse_args()


def run_all(args) -> dict[str, list[dict]]:
    """Every compression scheme under DDP, then every consistency mode without and with the
    straggler, on one local Ray: each run's per-epoch metrics by label."""
    import ray

    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ensure_dataset(bench_config(workdir, args, []))
        ray.init(num_cpus=2, logging_level="ERROR", log_to_driver=False)
        stamp = time.strftime("%H%M%S")
        try:
            for scheme in SCHEMES:
                cfg = bench_config(workdir, args, [f"parallelism.grad_compression={scheme}"])
                print(f"ddp, {scheme} ...", flush=True)
                runs[f"ddp/{scheme}"] = train(cfg, f"bench-{scheme}-{stamp}")
            for mode, overrides in MODES.items():
                for slow in (False, True):
                    label = f"{mode}{' + straggler' if slow else ''}"
                    print(f"{label} ...", flush=True)
                    extra = straggler(args) if slow else []
                    cfg = bench_config(workdir, args, [*overrides, *extra])
                    runs[label] = train(cfg, f"bench-{mode}-{int(slow)}-{stamp}")
        finally:
            ray.shutdown()
    return runs


def compression_table(runs: dict[str, list[dict]], epochs: int) -> tuple[dict, list[float]]:
    """(a): prints the table; each scheme's bytes ratio to fp32 and accuracy drops."""
    fp32 = runs["ddp/none"]
    print(f"\n(a) compression, {epochs} epochs, 2 workers")
    print(f"{'scheme':<10} {'bytes/step':>12} {'vs fp32':>8} {'val acc':>8} {'step ms':>8}")
    ratios, drops = {}, []
    for scheme in SCHEMES:
        last = runs[f"ddp/{scheme}"][-1]
        ratios[scheme] = last["comm_bytes_ratio"] if scheme != "none" else 1.0
        drops.append(fp32[-1]["val_accuracy"] - last["val_accuracy"])
        print(
            f"{scheme:<10} {last['comm_bytes_per_step']:>12,.0f} {ratios[scheme]:>8.3f} "
            f"{last['val_accuracy']:>8.3f} {last['step_ms']:>8.2f}"
        )
    return ratios, drops


def consistency_table(runs: dict[str, list[dict]], target: float) -> dict[str, float | None]:
    """(b): prints the table; each run's training seconds to `target` (None: never)."""
    print(f"\n(b) consistency, time to val accuracy {target}")
    header = f"{'mode':<22} {'to target s':>11} {'final acc':>9} {'step ms':>8} {'data':>6}"
    print(header + f" {'compute':>8} {'comm':>6} {'straggler':>9} {'staleness':>9}")
    reached = {}
    for mode in MODES:
        for label in (mode, f"{mode} + straggler"):
            history = runs[label]
            reached[label] = time_to(history, target)
            shown = "-" if reached[label] is None else f"{reached[label]:.2f}"
            last = history[-1]
            print(
                f"{label:<22} {shown:>11} {last['val_accuracy']:>9.3f} {last['step_ms']:>8.2f} "
                f"{last['step_data_wait_ms']:>6.2f} {last['step_compute_ms']:>8.2f} "
                f"{last['step_comm_ms']:>6.2f} {last['step_straggler_ms']:>9.2f} "
                f"{last.get('staleness_mean', 0.0):>9.2f}"
            )
    return reached


def main() -> None:
    args = parse_args()
    runs = run_all(args)
    ratios, drops = compression_table(runs, args.epochs)
    reached = consistency_table(runs, args.target)
    plot({k: v for k, v in runs.items() if not k.startswith("ddp/")}, args.plot)
    print(f"convergence plot: {args.plot}")

    def versus(mode: str) -> float | None:
        ours, sync = reached[f"{mode} + straggler"], reached["sync + straggler"]
        return None if ours is None or sync is None else round(ours / sync, 3)

    split_error = max(e["step_split_error"] for history in runs.values() for e in history)
    print(
        json.dumps(
            {
                "fp16_bytes_ratio": round(ratios["fp16"], 4),
                "powersgd_bytes_ratio": round(ratios["powersgd"], 4),
                "topk_bytes_ratio": round(ratios["topk"], 4),
                "max_acc_drop": round(max(drops), 4),
                "ssp_vs_sync_time_to_acc": versus("ssp"),
                "async_vs_sync_time_to_acc": versus("async"),
                "local_sgd_vs_sync_time_to_acc": versus("local_sgd"),
                "split_sum_error": round(split_error, 4),
                "target_accuracy": args.target,
                "epochs": args.epochs,
            }
        )
    )


if __name__ == "__main__":
    main()
