"""How far the profile-based cost model is from measurement, strategy by strategy.

One run: every strategy raylane has on the byte-level GPT at 2 and 4 workers (ddp, fsdp, tp,
fsdp x tp, pipeline with GPipe and 1F1B, hybrid, local SGD, ssp) is measured as a `raylane
tune` trial would be (predict off, no early stopping, one at a time on a local 2-CPU Ray), and
predicted from one profile of the same cluster (`raylane.plan.measured`). Each prediction is
shown raw (the profile alone) and calibrated the way `raylane tune`'s searcher calibrates it
while it searches: by the layouts measured before it (the median of their measured/predicted
ratios, `raylane.tune.calibration.pooled`), in the order they ran (ddp on 2 workers first,
which nothing calibrates and which is not scored). The last line is one JSON object: the
median |predicted - measured| / measured step time per strategy and overall.

`--family llama` measures a Llama-family decoder of the same size instead (grouped-query
attention, SwiGLU, rotary positions: `model.kind: llama`) in the layouts a Llama user runs at 2
workers (ddp, fsdp, tp, pipeline, and ddp with context parallelism), and scores each layout's
predicted peak worker memory against its measured peak resident memory as well.

    python benchmarks/prediction_error.py [--epochs 4] [--steps 16] [--save FILE]
    python benchmarks/prediction_error.py --family llama
    python benchmarks/prediction_error.py --figures-from FILE   # re-predict a saved run

`--save` keeps what was measured (the profile and every trial's step time and split), so that
`--figures-from` can score the current cost model against it without measuring again.
`--smoke` measures ddp and fsdp on 2 workers only (no repeat of the calibrating layout), 2
epochs of 1 step of a small model.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from harness import add_smoke_flag, print_last_line, ray_session

from raylane.data import ensure_dataset
from raylane.plan.measured import predict_config
from raylane.profile.job import load_or_measure
from raylane.tune.calibration import measured_calibration, pooled
from raylane.tune.candidates import Candidate, enumerate_candidates, trial_config
from raylane.tune.search import run_search
from raylane.tune.spec import TuneSpec

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "fsdp", "tp", "pipeline", "hybrid", "local_sgd", "ssp")
SMOKE_STRATEGIES = ("ddp", "fsdp")
#: The Llama's layouts at 2 workers (cp: ddp with each sequence split over both workers).
LLAMA_STRATEGIES = ("ddp", "fsdp", "tp", "pipeline")
#: A Llama of the GPT's width and depth: 4 query heads sharing 2 key/value heads, SwiGLU.
LLAMA_MODEL = ["model.kind=llama", "model.n_kv_heads=2", "model.ffn_dim=192"]
FAMILY_STRATEGIES = {"gpt": STRATEGIES, "llama": LLAMA_STRATEGIES}
#: A model small enough for a smoke run to profile and train in seconds.
SMOKE_MODEL = ["model.d_model=32", "model.n_layers=2", "model.input_dim=16", "data.max_bytes=16384"]


def make_spec(
    workdir: Path, epochs: int, steps: int, strategies=STRATEGIES, name: str = "out", smoke=False,
    family: str = "gpt",
) -> TuneSpec:  # fmt: skip
    llama = family == "llama"
    wide = len(strategies) > 1 and not smoke and not llama
    return TuneSpec.model_validate(
        {
            "experiment": "bench-prediction",
            "base": str(ROOT / "configs" / "train" / "lm_pipeline.yaml"),
            "base_overrides": [
                "data.max_bytes=131072",
                f"data.train_path={workdir}/data/train.parquet",
                f"data.validation_path={workdir}/data/validation.parquet",
                "parallelism.schedule=1f1b",
                *(SMOKE_MODEL if smoke else []),
                *(LLAMA_MODEL if llama else []),
            ],
            "search": {
                "strategy": list(strategies),
                "workers": [2, 4] if wide else [2],
                "pp": [2],
                "tp": [2],
                "cp": [1, 2] if llama and not smoke else [1],
                "microbatches": [4],
                "batch_size": [32],
            },
            "constraints": {"cpus": 2.0, "cpus_per_worker": 0.45},
            "trial": {"epochs": epochs, "steps_per_epoch": steps, "warmup_epochs": 1},
            "scheduler": {"kind": "none"},
            "predict": {"enabled": False},
            "output_dir": str(workdir / name),
            "storage_path": str(workdir / f"runs-{name}"),
            "tracking_uri": f"sqlite:///{workdir}/mlflow.db",
        }
    )


PARTS = ("compute", "comm", "bubble", "ring", "data_wait")


def measure(epochs: int, steps: int, smoke: bool = False, family: str = "gpt") -> dict:
    """Profile the cluster and run every layout as a trial; what was measured, as JSON."""
    strategies = SMOKE_STRATEGIES if smoke else FAMILY_STRATEGIES[family]
    with tempfile.TemporaryDirectory() as tmp, ray_session(num_cpus=2):
        workdir = Path(tmp)
        spec = make_spec(workdir, epochs, steps, strategies, smoke=smoke, family=family)
        candidates, _ = enumerate_candidates(spec)
        configs = [trial_config(spec, c) for c in candidates]
        widest = max(configs, key=lambda c: c.parallelism.workers)
        workers = sorted({c.parallelism.workers for c in configs})
        ensure_dataset(widest)
        profile, _, _ = load_or_measure(widest, spec.tracking_uri, concurrency=workers)
        grid = run_search(spec)
        # The calibrating layout once more, last: how far one layout's two measurements
        # are apart is the floor under any prediction's error.
        again = None
        if not smoke:
            again = run_search(make_spec(workdir, epochs, steps, ("ddp",), "again", family=family))
    trials = []
    for trial in grid.trials:
        split = {p: trial.metrics.get(f"step_{p}_ms", 0.0) for p in PARTS}
        trials.append(
            {"key": trial.candidate.key, "overrides": trial.candidate.overrides,
             "status": trial.status, "detail": trial.detail, "step_ms": trial.step_ms,
             "data_wait_ms": trial.data_wait_ms, "split_ms": split,
             "peak_rss_mb": trial.peak_rss_mb}
        )  # fmt: skip
    repeat = next((t.step_ms for t in again.trials if t.step_ms), None) if again else None
    return {
        "epochs": epochs, "steps": steps, "profile": profile, "trials": trials,
        "calibration_repeat_ms": repeat, "smoke": smoke, "family": family,
    }  # fmt: skip


def score(run: dict) -> dict:
    """Predict every measured layout from the run's profile with the current cost model."""
    smoke, family = run.get("smoke", False), run.get("family", "gpt")
    spec = make_spec(
        Path(tempfile.gettempdir()), run["epochs"], run["steps"], smoke=smoke, family=family
    )
    profile = run["profile"]
    measured = [t for t in run["trials"] if t["step_ms"]]
    raw = {
        t["key"]: predict_config(profile, trial_config(spec, Candidate(t["overrides"])))
        for t in measured
    }
    reference = next(t for t in measured if t["key"].startswith("ddp-w2"))
    own = {
        t["key"]: measured_calibration(t["key"], raw[t["key"]], t["step_ms"], t["data_wait_ms"],
                                       None)
        for t in measured
    }  # fmt: skip
    by_strategy, raw_by_strategy = print_layouts(run, measured, raw, own)
    everything = [e for errors in by_strategy.values() for e in errors]
    repeat = run.get("calibration_repeat_ms")
    calibration = pooled(list(own.values()))
    memory = {
        t["key"]: round((raw[t["key"]].memory_mb - t["peak_rss_mb"]) / t["peak_rss_mb"], 3)
        for t in measured
        if t.get("peak_rss_mb")
    }
    return {
        "family": family,
        "layouts": len(measured),
        "calibrated_by": "the layouts measured before each (median ratio)",
        "first_scale": round(own[measured[0]["key"]].step_scale, 3),
        "calibration_repeat_error": (
            round(abs(repeat - reference["step_ms"]) / reference["step_ms"], 3) if repeat else None
        ),
        "step_scale": round(calibration.step_scale, 3),
        "median_pred_error": round(statistics.median(everything), 3),
        "median_pred_error_raw": round(
            statistics.median(e for errors in raw_by_strategy.values() for e in errors), 3
        ),
        "by_strategy": {
            s: round(statistics.median(errors), 3) for s, errors in sorted(by_strategy.items())
        },
        "by_strategy_raw": {
            s: round(statistics.median(errors), 3) for s, errors in sorted(raw_by_strategy.items())
        },
        # (predicted - measured peak resident memory) / measured, per layout (raw profile).
        "memory_error": memory,
        "worst_memory_error": max((abs(e) for e in memory.values()), default=None),
    }


def print_layouts(run: dict, measured: list[dict], raw: dict, own: dict) -> tuple[dict, dict]:
    """Print each layout measured and predicted (calibrated by the layouts measured before
    it, as the searcher knew them then); each strategy's |errors|, calibrated and raw."""
    by_strategy: dict[str, list[float]] = defaultdict(list)
    raw_by_strategy: dict[str, list[float]] = defaultdict(list)
    print(f"{'layout':34s} {'':9s}" + "".join(f"{p:>10s}" for p in ("step", *PARTS)))
    for index, trial in enumerate(measured):
        key, step_ms = trial["key"], trial["step_ms"]
        before = [own[t["key"]] for t in measured[:index]]  # what the searcher knew by then
        calibration = pooled(before) if before else own[key]
        calibrated = calibration.apply(raw[key])
        error = (calibrated.step_ms - step_ms) / step_ms
        raw_error = (raw[key].step_ms - step_ms) / step_ms
        strategy = key.split("-")[0] + ("xtp" if "-tp2-" in key and key.startswith("fsdp") else "")
        strategy += "-cp" if "-cp2" in key else ""
        if before:
            by_strategy[strategy].append(abs(error))
        raw_by_strategy[strategy].append(abs(raw_error))
        parts = {p: 1000 * calibrated.parts.get(p, 0.0) for p in PARTS}
        print(f"{key:34s} measured " + f"{step_ms:10.1f}"
              + "".join(f"{trial['split_ms'][p]:10.1f}" for p in PARTS))  # fmt: skip
        print(f"{'':34s} predicted{calibrated.step_ms:10.1f}"
              + "".join(f"{parts[p]:10.1f}" for p in PARTS)
              + f"   ({error:+.0%}; raw {raw[key].step_ms:.1f} ms, {raw_error:+.0%})")  # fmt: skip
    for trial in run["trials"]:
        if not trial["step_ms"]:
            print(f"{trial['key']:34s} {trial['status']}: {trial['detail']}")
    return by_strategy, raw_by_strategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="Trial length (epochs).")
    parser.add_argument("--steps", type=int, default=16, help="Steps per epoch.")
    parser.add_argument("--save", type=Path, help="Write what was measured to this JSON file.")
    parser.add_argument(
        "--figures-from", type=Path, help="Score a run saved with --save instead of measuring."
    )
    parser.add_argument(
        "--family", choices=sorted(FAMILY_STRATEGIES), default="gpt",
        help="The model measured: raylane's GPT, or a Llama-family decoder of its size.",
    )  # fmt: skip
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.steps = 2, 1
    logging.basicConfig(level=logging.WARNING)
    if args.figures_from:
        run = json.loads(args.figures_from.read_text())
    else:
        run = measure(args.epochs, args.steps, args.smoke, args.family)
        if args.save:
            args.save.write_text(json.dumps(run))
    print_last_line(score(run), args.smoke or run.get("smoke", False))


if __name__ == "__main__":
    main()
