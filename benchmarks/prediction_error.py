"""How far the profile-based cost model is from measurement, strategy by strategy.

One run: every strategy raylane has on the byte-level GPT at 2 and 4 workers (ddp, fsdp, tp,
fsdp x tp, pipeline with GPipe and 1F1B, hybrid, local SGD, ssp) is measured as a `raylane
tune` trial would be (predict off, no early stopping, one at a time on a local 2-CPU Ray), and
predicted from one profile of the same cluster (`raylane.plan.measured`). Each prediction is
shown raw (the profile alone) and calibrated the way `raylane tune` calibrates it, by the
measurement of one layout (ddp on 2 workers, the first). The last line is one JSON object:
the median |predicted - measured| / measured step time per strategy and overall.

    python benchmarks/prediction_error.py [--epochs 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from raylane.tune.calibration import measured_calibration
from raylane.tune.search import run_search
from raylane.tune.spec import TuneSpec

ROOT = Path(__file__).resolve().parents[1]


def make_spec(workdir: Path, epochs: int, steps: int) -> TuneSpec:
    return TuneSpec.model_validate(
        {
            "experiment": "bench-prediction",
            "base": str(ROOT / "configs" / "train" / "lm_pipeline.yaml"),
            "base_overrides": [
                "data.max_bytes=131072",
                f"data.train_path={workdir}/data/train.parquet",
                f"data.validation_path={workdir}/data/validation.parquet",
                "parallelism.schedule=1f1b",
            ],
            "search": {
                "strategy": ["ddp", "fsdp", "tp", "pipeline", "hybrid", "local_sgd", "ssp"],
                "workers": [2, 4],
                "pp": [2],
                "tp": [2],
                "microbatches": [4],
                "batch_size": [32],
            },
            "constraints": {"cpus": 2.0, "cpus_per_worker": 0.45},
            "trial": {"epochs": epochs, "steps_per_epoch": steps, "warmup_epochs": 1},
            "scheduler": {"kind": "none"},
            "predict": {"enabled": False},
            "output_dir": str(workdir / "out"),
            "storage_path": str(workdir / "runs"),
            "tracking_uri": f"sqlite:///{workdir}/mlflow.db",
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="Trial length (epochs).")
    parser.add_argument("--steps", type=int, default=6, help="Steps per epoch.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import ray

    from raylane.data import ensure_dataset
    from raylane.plan.measured import predict_config
    from raylane.plan.profile_job import load_or_measure
    from raylane.tune.candidates import enumerate_candidates, trial_config

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        spec = make_spec(workdir, args.epochs, args.steps)
        ray.init(num_cpus=2, logging_level="ERROR", log_to_driver=False)
        try:
            candidates, _ = enumerate_candidates(spec)
            configs = {c.key: trial_config(spec, c) for c in candidates}
            widest = max(configs.values(), key=lambda c: c.parallelism.workers)
            workers = sorted({c.parallelism.workers for c in configs.values()})
            ensure_dataset(widest)
            profile, _, _ = load_or_measure(widest, spec.tracking_uri, concurrency=workers)
            grid = run_search(spec)
        finally:
            ray.shutdown()

    measured = [t for t in grid.trials if t.step_ms]
    raw = {t.candidate.key: predict_config(profile, configs[t.candidate.key]) for t in measured}
    reference = next(t for t in measured if t.candidate.key.startswith("ddp-w2"))
    calibration = measured_calibration(
        reference.candidate.key,
        raw[reference.candidate.key],
        reference.step_ms,
        reference.data_wait_ms,
        None,
    )
    by_strategy: dict[str, list[float]] = defaultdict(list)
    raw_by_strategy: dict[str, list[float]] = defaultdict(list)
    for trial in measured:
        key = trial.candidate.key
        calibrated = calibration.apply(raw[key])
        error = (calibrated.step_ms - trial.step_ms) / trial.step_ms
        raw_error = (raw[key].step_ms - trial.step_ms) / trial.step_ms
        strategy = key.split("-")[0] + ("xtp" if "-tp2-" in key and key.startswith("fsdp") else "")
        if key != calibration.layout:
            by_strategy[strategy].append(abs(error))
        raw_by_strategy[strategy].append(abs(raw_error))
        print(
            f"{key:34s} measured {trial.step_ms:7.1f} ms  predicted {calibrated.step_ms:7.1f} ms "
            f"({error:+.0%})  raw {raw[key].step_ms:7.1f} ms ({raw_error:+.0%})"
        )
    for trial in grid.trials:
        if not trial.step_ms:
            print(f"{trial.candidate.key:34s} {trial.status}: {trial.detail}")
    everything = [e for errors in by_strategy.values() for e in errors]
    figures = {
        "layouts": len(measured),
        "calibrated_by": calibration.layout,
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
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
