"""The planner (Ray Tune + ASHA) against an exhaustive grid of the same valid layouts.

Side by side in one run, on one fixed search space over the byte-level GPT: the grid measures
every valid layout for the full trial length (no prediction, no early stopping); the planner
is `raylane tune` as shipped: it profiles the model once, predicts every layout, and measures
at most the top k (3) under ASHA, best predicted first, stopping once the next is predicted
more than the margin (20 %) slower than the best measured.
Both run one trial at a time on the same local Ray. best_ratio = the grid's full-length
throughput of the planner's pick / the grid's best throughput (the same measurement for both,
so noise between runs does not enter); cost_ratio = planner wall time (profile included) /
grid wall time; median_pred_error = median over every grid layout of |planner's predicted -
grid's measured| / measured step time (median of the measured epochs); the raw figure is the
same for the profile's own predictions, before the planner's calibration by its measured
trials. The last line is one JSON object.

    python benchmarks/tune_vs_grid.py [--epochs 6] [--steps 6] [--smoke]
    python benchmarks/tune_vs_grid.py --family llama

`--family llama` searches the same space over a Llama-family decoder of the GPT's size
(`model.kind: llama`, 4 query heads sharing 2 key/value heads, a SwiGLU MLP).

`--smoke` searches one layout (ddp on 1 worker) for 2 epochs of 1 step, with a small model.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from harness import add_smoke_flag, print_last_line, ray_session
from rich.console import Console

from raylane.tune.report import print_table
from raylane.tune.search import run_search
from raylane.tune.spec import TuneSpec

ROOT = Path(__file__).resolve().parents[1]
SEARCH = {
    "strategy": ["ddp", "pipeline"],
    "workers": [1, 2],
    "microbatches": [4, 8],
    "batch_size": [16, 32],
    "grad_compression": ["none"],
}
SMOKE_SEARCH = {"strategy": ["ddp"], "workers": [1], "batch_size": [8]}
#: `--family`: the base model's overrides (gpt: the base config's own).
FAMILIES = {"gpt": [], "llama": ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_dim=192"]}
#: A model small enough for a smoke run to profile and train in seconds.
SMOKE_MODEL = ["model.d_model=32", "model.n_layers=2", "model.input_dim=16", "data.max_bytes=16384"]


def make_spec(workdir: Path, args, scheduler: str, top_k: int = 3) -> TuneSpec:
    epochs, steps = args.epochs, args.steps
    return TuneSpec.model_validate(
        {
            "experiment": f"bench-{scheduler}",
            "base": str(ROOT / "configs" / "train" / "lm_pipeline.yaml"),
            "base_overrides": [
                "data.max_bytes=131072",
                f"data.train_path={workdir}/data/train.parquet",
                f"data.validation_path={workdir}/data/validation.parquet",
                *(SMOKE_MODEL if args.smoke else []),
                *FAMILIES[args.family],
            ],
            "search": SMOKE_SEARCH if args.smoke else SEARCH,
            "trial": {"epochs": epochs, "steps_per_epoch": steps, "warmup_epochs": 1},
            "scheduler": {"kind": scheduler, "grace_period": 2, "reduction_factor": 3},
            "predict": {"enabled": scheduler != "none", "top_k": top_k},
            "output_dir": str(workdir / "out"),
            "storage_path": str(workdir / f"runs-{scheduler}"),
            "tracking_uri": f"sqlite:///{workdir}/mlflow.db",
        }
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6, help="Full trial length (epochs).")
    parser.add_argument("--steps", type=int, default=6, help="Steps per epoch.")
    parser.add_argument("--top-k", type=int, default=3, help="Layouts the planner measures.")
    parser.add_argument(
        "--family", choices=sorted(FAMILIES), default="gpt",
        help="The model searched: raylane's GPT, or a Llama-family decoder of its size.",
    )  # fmt: skip
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.steps, args.top_k = 2, 1, 1
    return args


def run_both(args):
    """The grid, then the planner, one trial at a time on the same local Ray."""
    with tempfile.TemporaryDirectory() as tmp, ray_session(num_cpus=2):
        workdir = Path(tmp)
        grid = run_search(make_spec(workdir, args, "none"))
        planner = run_search(make_spec(workdir, args, "asha", args.top_k))
    return grid, planner


def prediction_errors(grid, planner) -> tuple[dict[str, float], dict[str, float]]:
    """Print and return the planner's relative step-time error on every grid layout, after
    its calibration and before (the profile's own prediction)."""
    predicted = {t.candidate.key: t.predicted for t in [*planner.trials, *planner.not_run]}
    raw = planner.raw_predictions
    errors, raw_errors = {}, {}
    for trial in grid.trials:
        guess = predicted.get(trial.candidate.key)
        if trial.step_ms and guess is not None:
            errors[trial.candidate.key] = (guess.step_ms - trial.step_ms) / trial.step_ms
            raw_errors[trial.candidate.key] = (
                raw[trial.candidate.key].step_ms - trial.step_ms
            ) / trial.step_ms
    measured_ms = {t.candidate.key: t.step_ms for t in grid.trials}
    for key, error in errors.items():
        print(
            f"{key}: measured {measured_ms[key]:.1f} ms, predicted "
            f"{predicted[key].step_ms:.1f} ms ({error:+.0%}; before calibration "
            f"{raw_errors[key]:+.0%})"
        )
    return errors, raw_errors


def figures_of(
    grid, planner, errors: dict[str, float], raw_errors: dict[str, float], family: str = "gpt"
) -> dict:
    """The last line's figures."""
    grid_rate = {t.candidate.key: t.samples_per_s for t in grid.trials if t.status == "ok"}
    best_key = max(grid_rate, key=grid_rate.get)
    pick = planner.winner
    calibration = planner.calibration
    wait_ms = 1000 * calibration.data_wait_s if calibration else 0.0
    return {
        "family": family,
        "layouts": len(grid.trials),
        "grid_best": best_key,
        "grid_best_samples_per_s": round(grid_rate[best_key], 1),
        "planner_pick": pick.candidate.key,
        "planner_pick_samples_per_s_in_grid": round(grid_rate[pick.candidate.key], 1),
        "planner_pick_samples_per_s_own_trial": round(pick.samples_per_s, 1),
        "planner_stopped_early": sum(t.status == "stopped early" for t in planner.trials),
        "grid_wall_s": round(grid.wall_s, 1),
        "planner_wall_s": round(planner.wall_s, 1),
        "best_ratio": round(grid_rate[pick.candidate.key] / grid_rate[best_key], 3),
        "cost_ratio": round(planner.wall_s / grid.wall_s, 3),
        # A later search of the same model on the same cluster finds the profile in MLflow.
        "cost_ratio_profile_reused": round((planner.wall_s - planner.profile_s) / grid.wall_s, 3),
        "planner_measured": len(planner.trials),
        "profile_s": round(planner.profile_s, 1),
        "step_scale": round(calibration.step_scale, 3) if calibration else 1.0,
        "data_wait_ms": round(wait_ms, 1),
        "median_pred_error_raw": round(statistics.median(abs(e) for e in raw_errors.values()), 3),
        "median_pred_error": round(statistics.median(abs(e) for e in errors.values()), 3),
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(stderr=True, width=200)
    grid, planner = run_both(args)
    print_table(grid, console)
    print_table(planner, console)
    errors, raw_errors = prediction_errors(grid, planner)
    figures = figures_of(grid, planner, errors, raw_errors, args.family)
    print(
        f"grid: {figures['layouts']} layouts in {figures['grid_wall_s']} s, best "
        f"{figures['grid_best']}; planner: {figures['planner_wall_s']} s, pick "
        f"{figures['planner_pick']}"
    )
    print_last_line(figures, args.smoke)


if __name__ == "__main__":
    main()
