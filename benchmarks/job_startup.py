"""A small job's fixed cost: `raylane train` against the same training in a bare torch process.

Measured side by side in one run, each as a whole process (wall time from launch to exit), the
same 1-epoch digits job (configs/train/digits_ddp.yaml, 2 DDP workers):

  (a) bare: one plain Python process that reads the same Parquet files, builds the same model
      and trains one epoch on the same global batches (2 x batch_size rows), then evaluates;
  (b) fresh: `raylane train` with no RAY_ADDRESS (it starts and stops a local Ray);
  (c) warm: `raylane train` on an already running `ray start` cluster (RAY_ADDRESS);
  (d) ray_floor: a driver on the same running cluster that only runs a Ray Train TorchTrainer
      of 2 workers whose training function returns at once (Ray Train's own start and stop,
      without raylane, data or a model), with the controller's health checks every 0.5 s as
      raylane sets them; ray_floor_default: the same with Ray's default 2 s.

Each is repeated `--repeat` times (default 3) and the medians are reported; the phase figures
are the medians of the runs' own `phase_*_s` metrics (raylane.train.phases). The last line
printed is one JSON object with `fixed_overhead_s` (b - a), `fixed_overhead_warm_s` (c - a),
`ray_floor_s` and `ray_floor_default_s` (d), `raylane_over_floor_warm_s` (c - d - the bare
loop's training seconds: what raylane itself adds to a Ray Train job; target <= 8 s) and each
phase.

    python benchmarks/job_startup.py [--repeat 3] [--smoke]

With RAY_ADDRESS set, (c) and (d) run on that cluster (its clients' environment, token
included, as this process has it) instead of one this benchmark starts and stops. `--smoke`
runs each once, (d) with raylane's health-check interval only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harness import add_smoke_flag, free_port, print_last_line

from raylane.train.trainer import HEALTH_CHECK_ENV, HEALTH_CHECK_S

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "train" / "digits_ddp.yaml"

BARE = r"""
import sys, time, torch
from torch.nn import functional as F
from raylane.config import load_config
from raylane.data.parquet import read_rows
from raylane.models import build_model
cfg = load_config(sys.argv[1], sys.argv[2:])
torch.set_num_threads(1)
torch.manual_seed(cfg.training.seed)
x, y = (torch.as_tensor(a) for a in read_rows(cfg.data.train_path, cfg))
vx, vy = (torch.as_tensor(a) for a in read_rows(cfg.data.validation_path, cfg))
model = build_model(cfg.model)
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr)
rows = cfg.training.batch_size * cfg.parallelism.workers
began = time.perf_counter()
for epoch in range(cfg.training.epochs):
    order = torch.randperm(len(x))
    for start in range(0, len(x), rows):
        batch = order[start : start + rows]
        optimizer.zero_grad()
        F.cross_entropy(model(x[batch].float()), y[batch].long()).backward()
        optimizer.step()
print(f"training_s {time.perf_counter() - began:.3f}")
with torch.no_grad():
    accuracy = (model(vx.float()).argmax(-1) == vy.long()).float().mean().item()
print(f"val_accuracy {accuracy:.4f}")
"""

FLOOR = r"""
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
import sys
ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
TorchTrainer(
    lambda: None,
    scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
    run_config=RunConfig(storage_path=sys.argv[2], name=sys.argv[3]),
).fit()
"""


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:4])} failed:\n{done.stdout[-3000:]}{done.stderr}")
    return elapsed, done.stdout + done.stderr


def run_phases(tracking_uri: str, output: str) -> dict[str, float]:
    import re

    from mlflow.tracking import MlflowClient

    run_id = re.findall(r"run ([0-9a-f]{32})", output)[-1]
    metrics = MlflowClient(tracking_uri=tracking_uri).get_run(run_id).data.metrics
    return {k[len("phase_") : -len("_s")]: v for k, v in metrics.items() if k.startswith("phase_")}


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in samples[0] if all(k in s for s in samples)]
    return {k: round(statistics.median(s[k] for s in samples), 2) for k in keys}


def store(work: Path) -> str:
    """The MLflow store every run of this benchmark logs to."""
    return f"sqlite:///{work}/mlflow.db"


def with_sets(overrides: list[str]) -> list[str]:
    return [part for item in overrides for part in ("--set", item)]


def prepare(work: Path) -> tuple[list[str], dict[str, str]]:
    """The job's overrides (data, runs and tracking under `work`) and the environment every
    process runs with; the data set is prepared once, before anything is timed."""
    overrides = [
        f"data.train_path={work}/data/train.parquet",
        f"data.validation_path={work}/data/validation.parquet",
        f"training.storage_path={work}/runs",
        f"tracking.tracking_uri={store(work)}",
        "training.epochs=1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(MLFLOW_DISABLE_TELEMETRY="true", COLUMNS="200")
    subprocess.run(
        [str(BIN / "raylane"), "prepare", "--config", str(CONFIG), *with_sets(overrides)],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )  # fmt: skip
    return overrides, env


def cold_runs(args, work: Path, overrides: list[str], env: dict[str, str], figures, phases):
    """(a) and (b), `--repeat` times each."""
    raylane = [str(BIN / "raylane"), "train", "--config", str(CONFIG), *with_sets(overrides)]
    for _ in range(args.repeat):
        elapsed, output = timed([sys.executable, "-c", BARE, str(CONFIG), *overrides], env)
        figures["bare"].append(elapsed)
        figures["bare_training"].append(float(output.split("training_s ")[1].split()[0]))
        elapsed, output = timed(raylane, env)
        figures["fresh"].append(elapsed)
        phases["fresh"].append(run_phases(store(work), output))
        print(f"bare {figures['bare'][-1]:.1f} s, fresh {elapsed:.1f} s", flush=True)


def start_cluster(work: Path, env: dict[str, str]) -> tuple[int, dict[str, str]]:
    """A `ray start --head` on a free port; its port and the environment that reaches it."""
    port = free_port()
    # The cluster's token lives with this run (RAY_AUTH_TOKEN_PATH), not in ~/.ray.
    token = work / "auth_token"
    token.write_text(uuid.uuid4().hex)
    cluster_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}",
         f"--ray-client-server-port={free_port()}", "--disable-usage-stats"],
        env=cluster_env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return port, cluster_env


def warm_runs(args, work, overrides, address: str, cluster_env, figures, phases) -> None:
    """(c) and (d) on the running cluster, `--repeat` times each."""
    raylane = [str(BIN / "raylane"), "train", "--config", str(CONFIG), *with_sets(overrides)]
    warm_env = {**cluster_env, "RAY_ADDRESS": address}
    floors = (("ray_floor", HEALTH_CHECK_S), ("ray_floor_default", "2"))
    for index in range(args.repeat):
        elapsed, output = timed(raylane, warm_env)
        figures["warm"].append(elapsed)
        phases["warm"].append(run_phases(store(work), output))
        floor_command = [sys.executable, "-c", FLOOR, address, str(work / "floor")]
        for name, interval in floors[:1] if args.smoke else floors:
            floor_env = {**warm_env, HEALTH_CHECK_ENV: interval}
            elapsed, _ = timed([*floor_command, f"{name}-{index}"], floor_env)
            figures[name].append(elapsed)
        print(f"warm {figures['warm'][-1]:.1f} s, ray floor {figures['ray_floor'][-1]:.1f} s")


def report(figures: dict[str, list[float]], phases, repeat: int) -> dict:
    """Prints the phase medians; the last line's figures."""
    wall = {n: round(statistics.median(v), 2) if v else None for n, v in figures.items()}
    fresh, warm = medians(phases["fresh"]), medians(phases["warm"])
    for name, table in (("fresh local Ray", fresh), ("running cluster", warm)):
        print(f"phases, {name} (median s): " + " · ".join(f"{k} {v}" for k, v in table.items()))
    return {
        "bare_s": wall["bare"],
        "raylane_fresh_s": wall["fresh"],
        "raylane_warm_s": wall["warm"],
        "ray_floor_s": wall["ray_floor"],
        "ray_floor_default_s": wall["ray_floor_default"],
        "fixed_overhead_s": round(wall["fresh"] - wall["bare"], 2),
        "fixed_overhead_warm_s": round(wall["warm"] - wall["bare"], 2),
        "bare_training_s": wall["bare_training"],
        # What raylane adds to a Ray Train job on a running cluster: its warm wall time less
        # Ray Train's own floor and the training itself (the bare loop's).
        "raylane_over_floor_warm_s": round(
            wall["warm"] - wall["ray_floor"] - wall["bare_training"], 2
        ),
        "phases_fresh_s": fresh,
        "phases_warm_s": warm,
        "repeat": repeat,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.repeat = 1 if args.smoke else args.repeat

    work = Path(tempfile.mkdtemp(prefix="raylane-job-startup-"))
    overrides, env = prepare(work)
    figures: dict[str, list[float]] = {
        "bare": [], "bare_training": [], "fresh": [], "warm": [], "ray_floor": [],
        "ray_floor_default": [],
    }  # fmt: skip
    phases: dict[str, list[dict[str, float]]] = {"fresh": [], "warm": []}
    cold_runs(args, work, overrides, env, figures, phases)
    joined = os.environ.get("RAY_ADDRESS")
    if joined:  # a running cluster: reached with this process's own Ray environment
        cluster_env = {**env, **{k: v for k, v in os.environ.items() if k.startswith("RAY_")}}
    else:
        port, cluster_env = start_cluster(work, env)
    try:
        warm_runs(args, work, overrides, joined or f"127.0.0.1:{port}", cluster_env, figures,
                  phases)  # fmt: skip
    finally:
        if not joined:
            subprocess.run([str(BIN / "ray"), "stop", "--force"], env=cluster_env,
                           capture_output=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
    print_last_line(report(figures, phases, args.repeat), args.smoke)


if __name__ == "__main__":
    main()
