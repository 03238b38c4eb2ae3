"""The benchmarks that need Ray run in their smoke mode (`--smoke`: their real code path once, at
toy sizes) on the session's cluster, which they join through RAY_ADDRESS and its clients'
environment (token authentication on) instead of starting a Ray of their own. Each must end
with the JSON object it reports, marked smoke, with its keys and types.

Every Ray Train fit, Tune trial or Serve deployment costs 10-20 s of start-up here whatever its
size, so the default run smokes `pipeline_bubble.py` (one fit, about 18 s on 2 cores);
RAYLANE_BENCH_SMOKE=all adds the others (measured on 2 cores: train_overhead 30 s,
memory_layouts 34 s, consistency 43 s, serve_load 47 s, tune_vs_grid 64 s, job_startup 72 s,
prediction_error 92 s). `elastic.py` is not here: it builds a multi-node cluster of its own and
stops every Ray on the machine (`ray stop`), the session's included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
ALL = os.environ.get("RAYLANE_BENCH_SMOKE") == "all"


def number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def pipeline_bubble(last: dict) -> None:
    for schedule in ("gpipe", "1f1b"):
        run = last[schedule]["m8"]
        assert 0 < run["efficiency"] <= 1.05 and 0 < run["bound"] < 1, run
    assert last["gpipe"]["m1"]["bound"] == pytest.approx(0.5)  # 1 - (p - 1) / (m + p - 1)
    assert number(last["ratio_m8_gpipe"]) and number(last["ratio_m8_1f1b"])


def memory_layouts(last: dict) -> None:
    # FSDP shards parameters, gradients and optimizer state over 2 workers: well under DDP's.
    assert 0.3 < last["fsdp_state_ratio"] < 0.8
    assert number(last["fsdp_vs_ddp_throughput"])
    assert last["tp_state_ratio"] is None and last["fsdp4_state_ratio"] is None  # not run


def consistency(last: dict) -> None:
    assert last["max_acc_drop"] == 0.0  # one scheme: fp32 against itself
    assert last["fp16_bytes_ratio"] is None  # not run
    assert 0 <= last["split_sum_error"] < 0.5


def train_overhead(last: dict) -> None:
    for key in ("torch_samples_per_s", "ray2_samples_per_s", "ddp2_samples_per_s"):
        assert number(last[key]), key
    assert last["ray1_samples_per_s"] is None  # not run
    assert last["rows_per_epoch"] > 1000


def tune_vs_grid(last: dict) -> None:
    assert last["layouts"] == 1 and last["planner_pick"] == last["grid_best"]
    assert last["best_ratio"] == 1.0 and number(last["cost_ratio"])


def prediction_error(last: dict) -> None:
    # ddp, fsdp and fsdp x tp on 2 workers; ddp first, which nothing calibrates.
    assert last["layouts"] == 3 and {"ddp", "fsdp"} <= set(last["by_strategy_raw"])
    assert number(last["median_pred_error_raw"])


def serve_load(last: dict) -> None:
    for key in ("serve_rows_per_s", "fastapi_rows_per_s", "fastapi_batched_rows_per_s"):
        assert number(last[key]), key
    assert last["replicas"] >= 1 and last["mean_batch_size"] >= 1


def job_startup(last: dict) -> None:
    for key in ("bare_s", "raylane_fresh_s", "raylane_warm_s", "ray_floor_s"):
        assert number(last[key]), key
    assert last["ray_floor_default_s"] is None and last["repeat"] == 1
    assert set(last["phases_warm_s"]) >= {"worker_group", "training"}


DEFAULT = {"pipeline_bubble": pipeline_bubble}
SLOW = {
    "memory_layouts": memory_layouts,
    "consistency": consistency,
    "train_overhead": train_overhead,
    "tune_vs_grid": tune_vs_grid,
    "prediction_error": prediction_error,
    "serve_load": serve_load,
    "job_startup": job_startup,
}


@pytest.mark.parametrize(
    "name",
    [
        *DEFAULT,
        *(
            pytest.param(n, marks=pytest.mark.skipif(not ALL, reason="RAYLANE_BENCH_SMOKE=all"))
            for n in SLOW
        ),
    ],
)
def test_benchmark_smoke_on_the_session_cluster(name, ray_cluster, tmp_path):
    env = {**ray_cluster.client_env, "RAY_ADDRESS": ray_cluster.address}
    extra = ["--plot", str(tmp_path / "plot.png")] if name == "consistency" else []
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", *extra],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["smoke"] is True  # smoke figures can never pass for measurements
    {**DEFAULT, **SLOW}[name](last)
