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

    python benchmarks/consistency.py [--epochs 8] [--target 0.94] [--delay 0.1] [--smoke]

`--smoke` runs two setups (ddp with fp32 gradients, async with the straggler), 2 epochs of 2
steps each: the ratios that need the others are null.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness import add_smoke_flag, print_last_line, ray_session

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
SMOKE_SCHEMES = ["none"]
SMOKE_MODES = [("async", True)]  # (mode, with the straggler)


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
            *([f"training.steps_per_epoch={args.steps}"] if args.steps else []),
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
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.steps = None  # every batch of the split per epoch
    if args.smoke:
        args.epochs, args.steps, args.hidden, args.every, args.delay = 2, 2, "[16]", 1, 0.01
    return args


def run_all(args) -> dict[str, list[dict]]:
    """Every compression scheme under DDP, then every consistency mode without and with the
    straggler, on one local Ray: each run's per-epoch metrics by label."""
    runs: dict[str, list[dict]] = {}
    every_mode = [(mode, slow) for mode in MODES for slow in (False, True)]
    schemes, modes = (SMOKE_SCHEMES, SMOKE_MODES) if args.smoke else (SCHEMES, every_mode)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ensure_dataset(bench_config(workdir, args, []))
        stamp = time.strftime("%H%M%S")
        with ray_session(num_cpus=2):
            for scheme in schemes:
                cfg = bench_config(workdir, args, [f"parallelism.grad_compression={scheme}"])
                print(f"ddp, {scheme} ...", flush=True)
                runs[f"ddp/{scheme}"] = train(cfg, f"bench-{scheme}-{stamp}")
            for mode, slow in modes:
                label = f"{mode}{' + straggler' if slow else ''}"
                print(f"{label} ...", flush=True)
                extra = straggler(args) if slow else []
                cfg = bench_config(workdir, args, [*MODES[mode], *extra])
                runs[label] = train(cfg, f"bench-{mode}-{int(slow)}-{stamp}")
    return runs


def compression_table(runs: dict[str, list[dict]], epochs: int) -> tuple[dict, list[float]]:
    """(a): prints the table; each scheme's bytes ratio to fp32 and accuracy drops."""
    fp32 = runs["ddp/none"]
    print(f"\n(a) compression, {epochs} epochs, 2 workers")
    print(f"{'scheme':<10} {'bytes/step':>12} {'vs fp32':>8} {'val acc':>8} {'step ms':>8}")
    ratios, drops = {}, []
    for scheme in (s for s in SCHEMES if f"ddp/{s}" in runs):
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
        for label in (x for x in (mode, f"{mode} + straggler") if x in runs):
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
        ours, sync = reached.get(f"{mode} + straggler"), reached.get("sync + straggler")
        return None if ours is None or sync is None else round(ours / sync, 3)

    split_error = max(e["step_split_error"] for history in runs.values() for e in history)

    def ratio(scheme: str) -> float | None:
        return round(ratios[scheme], 4) if scheme in ratios else None  # None: not run

    print_last_line(
        {
            "fp16_bytes_ratio": ratio("fp16"),
            "powersgd_bytes_ratio": ratio("powersgd"),
            "topk_bytes_ratio": ratio("topk"),
            "max_acc_drop": round(max(drops), 4),
            "ssp_vs_sync_time_to_acc": versus("ssp"),
            "async_vs_sync_time_to_acc": versus("async"),
            "local_sgd_vs_sync_time_to_acc": versus("local_sgd"),
            "split_sum_error": round(split_error, 4),
            "target_accuracy": args.target,
            "epochs": args.epochs,
        },
        args.smoke,
    )


if __name__ == "__main__":
    main()
