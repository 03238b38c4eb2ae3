"""The pipeline bubble, measured against the GPipe bound.

p = 2 stages on 2 Ray Train workers (one torch thread each), the same global batch cut into
m in {1, 2, 4, 8, 16} micro-batches, under GPipe and 1F1B. Each step records each stage's
compute time (its forward/backward chunks) against the step's wall time; pipeline efficiency
is total compute / (p x wall), the GPipe bound is 1 - (p - 1) / (m + p - 1). Also reported:
the peak activation bytes autograd holds per stage (1F1B should hold fewer at large m).
torch's 1F1B needs m >= p, so it starts at m = 2.

The model is the raylane GPT, fed random tokens (the bubble does not depend on the data).
The last line printed is one JSON object, with `ratio_m8_gpipe` = measured / bound at m = 8.

    python benchmarks/pipeline_bubble.py [--steps 8] [--batch 64] [--d-model 256] [--smoke]

`--smoke` runs m in {1, 8} for one step after one warm-up on a 2-block d_model 32 GPT.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import add_smoke_flag, print_last_line, ray_session

from raylane.config import load_config
from raylane.models import build_model
from raylane.models.losses import cross_entropy
from raylane.parallel import get_strategy

ROOT = Path(__file__).resolve().parents[1]
MICROBATCHES = (1, 2, 4, 8, 16)
SCHEDULES = ("gpipe", "1f1b")


def _worker(loop_config: dict) -> list[dict]:
    """Every (schedule, m) on the same worker group; warm-up steps excluded."""
    import ray.train
    import torch

    rank = ray.train.get_context().get_world_rank()
    torch.set_num_threads(1)
    results = []
    for schedule in SCHEDULES:
        for m in loop_config["microbatches"]:
            cfg = load_config(loop_config["config_path"], [
                *loop_config["overrides"], f"parallelism.schedule={schedule}",
                f"parallelism.microbatches={max(m, 2)}",
            ])  # fmt: skip
            if m < cfg.parallelism.pp and schedule == "1f1b":
                continue  # torch's 1F1B needs m >= p
            torch.manual_seed(0)
            strategy = get_strategy(cfg, rank)
            # GPipe at m = 1 is a pipeline with no overlap at all, the bound's worst case; the
            # config refuses it for training, so the benchmark sets it on the strategy.
            strategy.microbatches = m
            model = strategy.wrap_model(build_model(cfg.model))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            generator = torch.Generator().manual_seed(1)
            shape = (cfg.training.batch_size, cfg.model.input_dim + 1)
            tokens = torch.randint(0, 256, shape, generator=generator)
            for step in range(loop_config["warmup"] + loop_config["steps"]):
                if step == loop_config["warmup"]:
                    strategy.timer.reset()
                    strategy.activations.reset()
                strategy.train_step(model, optimizer, cross_entropy, tokens[:, :-1], tokens[:, 1:])
            stats = strategy.epoch_stats()
            wall_s = stats["stage0_busy_s"] + stats["stage0_idle_s"]
            stats.update(schedule=schedule, microbatches=m, step_s=wall_s / loop_config["steps"])
            results.append(stats)
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="Measured steps per setting.")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="Global batch (rows).")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.batch, args.d_model, args.layers, args.context = (
            1, 1, 16, 32, 2, 16
        )  # fmt: skip
    return args


def run_all(args) -> list[dict]:
    """Every (schedule, m) on 2 Ray Train workers of a local Ray: the first worker's stats."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    overrides = [
        f"training.batch_size={args.batch}",
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"model.input_dim={args.context}",
        "parallelism.pp=2",
        "parallelism.workers=2",
    ]
    with ray_session(num_cpus=2), tempfile.TemporaryDirectory() as tmp:
        trainer = TorchTrainer(
            _worker,
            train_loop_config={
                "config_path": str(ROOT / "configs" / "train" / "lm_pipeline.yaml"),
                "overrides": overrides,
                "steps": args.steps,
                "warmup": args.warmup,
                "microbatches": (1, 8) if args.smoke else MICROBATCHES,
            },
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=tmp, name="pipeline-bubble"),
        )
        return trainer.fit().return_value


def main() -> None:
    args = parse_args()
    results = run_all(args)
    print(f"p=2, global batch {args.batch}, GPT d_model={args.d_model} layers={args.layers} "
          f"context={args.context}, {args.steps} measured steps per setting")  # fmt: skip
    header = f"{'schedule':<8} {'m':>3} {'step ms':>8} {'efficiency':>10} {'bound':>6} "
    print(header + f"{'ratio':>6} {'stage0 act MB':>13} {'stage1 act MB':>13}")
    figures: dict = {}
    for r in results:
        bound = 1 - r["bubble_bound_gpipe"]
        ratio = r["pipeline_efficiency"] / bound
        print(
            f"{r['schedule']:<8} {r['microbatches']:>3} {r['step_s'] * 1000:>8.1f} "
            f"{r['pipeline_efficiency']:>10.3f} {bound:>6.3f} {ratio:>6.3f} "
            f"{r['stage0_peak_activation_mb']:>13.1f} {r['stage1_peak_activation_mb']:>13.1f}"
        )
        figures.setdefault(r["schedule"], {})[f"m{r['microbatches']}"] = {
            "efficiency": round(r["pipeline_efficiency"], 4),
            "bound": round(bound, 4),
            "ratio": round(ratio, 4),
            "stage0_peak_activation_mb": round(r["stage0_peak_activation_mb"], 2),
        }
    figures["ratio_m8_gpipe"] = figures["gpipe"]["m8"]["ratio"]
    figures["ratio_m8_1f1b"] = figures["1f1b"]["m8"]["ratio"]
    print_last_line(figures, args.smoke)


if __name__ == "__main__":
    main()
