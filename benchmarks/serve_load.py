"""The raylane Serve endpoint against what a user would write instead, under the same load.

Side by side in one run, one wide MLP (64 -> 4 x 2048 -> 10, trained briefly on digits and
registered in a throw-away MLflow store; a single-row forward costs a few milliseconds), one
torch thread for the model in every setup:

  (b) plain FastAPI + uvicorn, one process, one forward per request (benchmarks/plain_fastapi.py);
  (d) plain FastAPI + uvicorn, one process, with its own asyncio micro-batcher
      (benchmarks/plain_fastapi_batched.py): the strongest single process a user could write;
  (c) the bare model's in-process forward on full batches (`--batch-size` rows): the ceiling;
  (a) the raylane Serve application as deployed by default (`raylane.serving.app.deploy` on a
      Ray started with the config's ingress, HAProxy unless `--set serving.ingress=proxy`;
      default serving settings: batches of 32, autoscaling 1-2 replicas of 0.5 CPU), measured
      once autoscaling has settled under the load;
  (a1) the same app pinned to one replica of one CPU: the like-for-like peer of (d).

(a), (b) and (d) get the same closed-loop load: `--clients` keep-alive connections from
raylane.serving.loadgen on 127.0.0.1, one row per request, for `--seconds` (after a warm-up)
or `--max-requests`. Then the large-input case: `--large-rows` rows (16,384 floats) per
request to (a) from `--large-clients` clients, as JSON and as OIP binary tensor data.
The table gives throughput, p50/p95/p99 latency, mean batch size and the load generator's own
CPU share; the last line is one JSON object with the ratios ((a) against the others, and
`one_replica_*` for (a1)).

    python benchmarks/serve_load.py [--clients 32] [--seconds 15] [--batch-size 32]
        [--set serving.ingress=proxy] [--smoke]

`--smoke`: every setup, an MLP 64 -> 32 -> 10 trained one epoch, 2 clients for 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import mlflow
import numpy as np
import ray
import torch
from harness import add_smoke_flag, free_port, print_last_line, wait_for_port
from ray import serve
from sklearn.datasets import load_digits

from raylane.config import load_config
from raylane.models import build_model
from raylane.runtime import connect_ray
from raylane.serving.app import deploy, stop_serve
from raylane.serving.inference import Predictor
from raylane.serving.ingress import apply_ingress_env
from raylane.serving.loadgen import LoadResult, run_load
from raylane.serving.status import state_name
from raylane.tracking.runs import log_trained_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-mlp"
HIDDEN = "[2048,2048,2048,2048]"


def bench_config(workdir: Path, args, port: int, one_replica: bool = False):
    """The reference config with the benchmark's model; serving settings stay the defaults
    (`one_replica`: pinned to one replica of one CPU, after `--set`)."""
    pinned = [
        "serving.replica_cpus=1",
        "serving.autoscaling.min_replicas=1",
        "serving.autoscaling.max_replicas=1",
    ]
    return load_config(
        ROOT / "configs" / "train" / "digits_ddp.yaml",
        [
            "experiment=serve-load",
            f"tracking.tracking_uri=sqlite:///{workdir}/mlflow.db",
            f"tracking.registered_model={MODEL}",
            f"model.hidden_sizes={'[32]' if args.smoke else HIDDEN}",
            f"serving.model_name={MODEL}",
            f"serving.port={port}",
            *args.overrides,
            *(pinned if one_replica else []),
        ],
    )


def register_model(cfg, epochs: int = 2) -> float:
    """Train the wide MLP for `epochs` on digits, log and register it; return accuracy."""
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target)
    model = build_model(cfg.model)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for start in range(0, len(x), 64):
            loss = torch.nn.functional.cross_entropy(
                model(x[start : start + 64]), y[start : start + 64]
            )
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    mlflow.set_experiment(cfg.experiment)
    with mlflow.start_run(run_name="serve-load"):
        info = log_trained_model(model, cfg, digits.data[:2].astype(np.float32))
    client = mlflow.MlflowClient(cfg.tracking.tracking_uri)
    client.set_registered_model_alias(MODEL, "champion", str(info.registered_model_version))
    return accuracy


def features(rows: np.ndarray) -> dict:
    """The request's one input tensor, without its data."""
    return {"name": "features", "shape": list(rows.shape), "datatype": "FP32"}


def infer_body(rows: np.ndarray) -> dict:
    rows = rows.reshape(-1, rows.shape[-1])
    return {"inputs": [{**features(rows), "data": rows.reshape(-1).tolist()}]}


def binary_infer_body(rows: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """The same request in the OIP binary tensor data extension, binary outputs asked for."""
    raw = rows.astype("<f4").tobytes()
    tensor = {**features(rows), "parameters": {"binary_data_size": len(raw)}}
    header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + raw, headers


def measure(url: str, body, args, clients: int | None = None, headers: dict | None = None):
    path = f"/v2/models/{MODEL}/infer"
    load = {"clients": clients or args.clients, "headers": headers}
    warm_s, warm_requests = min(2.0, args.seconds), min(5_000, args.max_requests)
    warm = run_load(url, path, body, duration_s=warm_s, max_requests=warm_requests, **load)
    if warm.statuses[200] == 0:
        raise RuntimeError(f"{url} answered no request during warm-up: {dict(warm.statuses)}")
    result = run_load(
        url, path, body, duration_s=args.seconds, max_requests=args.max_requests, **load
    )
    failed = result.requests - result.statuses[200] + len(result.failures)
    if failed:
        raise RuntimeError(f"{url}: {failed} failed requests ({dict(result.statuses)})")
    return result


def bare_forward(cfg, batch_size: int, seconds: float) -> tuple[float, float]:
    """Samples/s of the registered model's forward on full batches, and the batch-1 ms."""
    torch.set_num_threads(1)
    predictor = Predictor.from_registry(cfg.tracking.tracking_uri, MODEL, "champion")
    batch = np.random.default_rng(0).uniform(0, 16, (batch_size, 64)).astype(np.float32)
    single = batch[:1]
    for _ in range(20):
        predictor.predict(batch)
    timings = []
    for _ in range(200):
        started = time.perf_counter()
        predictor.predict(single)
        timings.append(time.perf_counter() - started)
    single_ms = 1000 * float(np.median(timings))
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        predictor.predict(batch)
        count += 1
    return count * batch_size / (time.perf_counter() - started), single_ms


def plain_fastapi(cfg, args, port: int, module: str = "plain_fastapi"):
    env = {
        **os.environ,
        "RAYLANE_BENCH_TRACKING_URI": cfg.tracking.tracking_uri,
        "RAYLANE_BENCH_MODEL": MODEL,
        "RAYLANE_BENCH_TORCH_THREADS": "1",
        "RAYLANE_BENCH_BATCH": str(args.batch_size),
        "RAYLANE_BENCH_BATCH_WAIT": str(args.batch_wait),
    }
    uvicorn = [sys.executable, "-m", "uvicorn", f"benchmarks.{module}:app", "--log-level"]
    server = subprocess.Popen(
        [*uvicorn, "warning", "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_port(port, server)
        return measure(url, infer_body(args.row), args)
    finally:
        server.terminate()
        server.wait(timeout=30)


def replica_states(app_name: str) -> dict[str, int]:
    deployment = serve.status().applications[app_name].deployments["model"]
    return {state_name(state): n for state, n in deployment.replica_states.items()}


def settle(url: str, cfg, args) -> int:
    """Load the endpoint until autoscaling runs the replicas this load asks for (clients /
    target in flight per replica, within min/max; or 180 s); return the running replicas."""
    scaling = cfg.serving.autoscaling
    target = scaling.target_ongoing_requests or cfg.serving.max_batch_size
    wanted = min(max(math.ceil(args.clients / target), scaling.min_replicas), scaling.max_replicas)
    deadline = time.monotonic() + 180.0
    while True:
        states = replica_states(cfg.serving.app_name)
        if states == {"RUNNING": wanted} or time.monotonic() > deadline:
            return states.get("RUNNING", 0)
        print(f"  waiting for autoscaling: {states}, want {wanted} running", flush=True)
        path = f"/v2/models/{MODEL}/infer"
        run_load(url, path, infer_body(args.row), clients=args.clients, duration_s=3.0)


def batch_counts(url: str, samples: int = 24) -> dict[str, tuple[int, int]]:
    """(batches, requests) so far per replica, from the stats route asked `samples` times."""
    seen = {}
    with httpx.Client() as client:
        for _ in range(samples):
            stats = client.get(f"{url}/v2/models/{MODEL}/stats").json()["model_stats"][0]
            seen[stats["replica"]] = (stats["batches"], stats["requests"])
    return seen


def measure_served(url: str, args):
    """Load result and mean batch size over the replicas seen before and after."""
    before = batch_counts(url)
    result = measure(url, infer_body(args.row), args)
    after = batch_counts(url)
    both = before.keys() & after.keys()
    batches = sum(after[r][0] - before[r][0] for r in both)
    requests = sum(after[r][1] - before[r][1] for r in both)
    return result, requests / batches if batches else 0.0


def raylane_serve(cfg, pinned_cfg, args) -> tuple:
    """(a) and (a1), in `Measured`'s order: replicas, (a) and its mean batch, (a1) and its
    mean batch, the large requests as JSON and as binary tensors."""
    # A Ray started here runs the config's ingress; a cluster keeps what it was started with.
    started = connect_ray(before_local_start=lambda: apply_ingress_env(cfg.serving.ingress))
    try:
        url, _ = deploy(cfg)
        replicas = settle(url, cfg, args)
        served = measure_served(url, args)
        large = np.random.default_rng(2).uniform(0, 16, (args.large_rows, 64)).astype(np.float32)
        large_json = measure(url, infer_body(large), args, clients=args.large_clients)
        binary, headers = binary_infer_body(large)
        large_binary = measure(url, binary, args, clients=args.large_clients, headers=headers)
        deploy(pinned_cfg)  # Serve rolls the app onto one replica of one CPU
        while replica_states(cfg.serving.app_name) != {"RUNNING": 1}:
            time.sleep(1.0)
        pinned = measure_served(url, args)
        return replicas, *served, *pinned, large_json, large_binary
    finally:
        stop_serve(local_ray=started, app_name=cfg.serving.app_name)  # other apps keep serving
        ray.shutdown()


@dataclass
class Measured:
    """Every setup's figures (the letters of the module docstring)."""

    plain: LoadResult  # (b)
    batched: LoadResult  # (d)
    bare_rate: float  # (c), rows/s
    single_ms: float  # the bare single-row forward
    replicas: int  # (a), once autoscaling settled
    served: LoadResult  # (a)
    mean_batch: float
    pinned: LoadResult  # (a1)
    pinned_batch: float
    large_json: LoadResult
    large_binary: LoadResult


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--max-requests", type=int, default=60_000)
    parser.add_argument("--large-rows", type=int, default=256, help="rows per large request")
    parser.add_argument("--large-clients", type=int, default=8)
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override"
    )
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.seconds, args.max_requests = 2, 0.3, 50
        args.large_rows, args.large_clients = 4, 1
    return args


def measure_all(args):
    """Register the model in a throw-away store and measure every setup; the config and the
    figures."""
    with tempfile.TemporaryDirectory(prefix="raylane-serve-load-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        cfg = bench_config(workdir, args, port)
        pinned_cfg = bench_config(workdir, args, port, one_replica=True)
        # (d) batches like the replica: same batch size and wait.
        args.batch_size = cfg.serving.max_batch_size
        args.batch_wait = cfg.serving.batch_wait_timeout_s
        accuracy = register_model(cfg, epochs=1 if args.smoke else 2)
        hidden = cfg.model.hidden_sizes
        print(f"model: MLP 64 -> {hidden} -> 10, training accuracy {accuracy:.3f}", flush=True)
        args.row = np.random.default_rng(1).uniform(0, 16, 64).astype(np.float32)

        plain = plain_fastapi(cfg, args, free_port())
        batched = plain_fastapi(cfg, args, free_port(), module="plain_fastapi_batched")
        bare = bare_forward(cfg, args.batch_size, seconds=0.2 if args.smoke else 5.0)
        return cfg, Measured(plain, batched, *bare, *raylane_serve(cfg, pinned_cfg, args))


def table_row(name: str, result: LoadResult | None, rate: float, batch: float | None) -> str:
    shown = "-" if batch is None else f"{batch:.1f}"  # None: not counted for this setup
    if result is None:
        return f"{name:<28} {rate:>9.0f} {'-':>8} {'-':>8} {'-':>8} {shown:>6} {'-':>7}"
    return (
        f"{name:<28} {rate:>9.0f} {result.percentile_ms(50):>8.1f} "
        f"{result.percentile_ms(95):>8.1f} {result.percentile_ms(99):>8.1f} {shown:>6} "
        f"{result.client_cpu_share:>7.0%}"
    )


def print_table(args, ingress: str, m: Measured) -> None:
    large_json_rate = m.large_json.throughput * args.large_rows
    large_binary_rate = m.large_binary.throughput * args.large_rows
    print(
        f"\n{args.clients} clients, one row per request, single-row forward "
        f"{m.single_ms:.2f} ms, ingress {ingress}"
    )
    print(
        f"{'setup':<28} {'rows/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'batch':>6} "
        f"{'client':>7}"
    )
    served = f"(a) raylane Serve, {m.replicas} repl."
    print(table_row(served, m.served, m.served.throughput, m.mean_batch))
    print(table_row("(a1) raylane, 1 replica", m.pinned, m.pinned.throughput, m.pinned_batch))
    print(table_row("(b) plain FastAPI", m.plain, m.plain.throughput, 1.0))
    print(table_row("(d) FastAPI + micro-batcher", m.batched, m.batched.throughput, None))
    print(table_row("(c) bare batched forward", None, m.bare_rate, float(args.batch_size)))
    print(f"\n{args.large_clients} clients, {args.large_rows} rows ({args.large_rows * 64} floats)")
    print(table_row("(a) raylane, JSON", m.large_json, large_json_rate, None))
    print(table_row("(a) raylane, binary tensors", m.large_binary, large_binary_rate, None))


def summary(args, ingress: str, m: Measured) -> dict:
    """The last line's figures: (a) against the others, and (a1)'s as `one_replica_*`."""
    served, plain, batched, pinned = m.served, m.plain, m.batched, m.pinned
    large_json_rate = m.large_json.throughput * args.large_rows
    large_binary_rate = m.large_binary.throughput * args.large_rows
    return {
        "serve_rows_per_s": round(served.throughput, 1),
        "fastapi_rows_per_s": round(plain.throughput, 1),
        "bare_rows_per_s": round(m.bare_rate, 1),
        "fastapi_batched_rows_per_s": round(batched.throughput, 1),
        "serve_vs_fastapi": round(served.throughput / plain.throughput, 3),
        "serve_vs_bare": round(served.throughput / m.bare_rate, 3),
        "serve_vs_fastapi_batched": round(served.throughput / batched.throughput, 3),
        "large_json_rows_per_s": round(large_json_rate, 1),
        "large_binary_rows_per_s": round(large_binary_rate, 1),
        "binary_vs_json": round(large_binary_rate / large_json_rate, 3),
        "p99_ms": round(served.percentile_ms(99), 1),
        "fastapi_p99_ms": round(plain.percentile_ms(99), 1),
        "mean_batch_size": round(m.mean_batch, 2),
        "replicas": m.replicas,
        "one_replica_rows_per_s": round(pinned.throughput, 1),
        "one_replica_vs_fastapi_batched": round(pinned.throughput / batched.throughput, 3),
        "one_replica_p99_ms": round(pinned.percentile_ms(99), 1),
        "clients": args.clients,
        "ingress": ingress,
    }


def main() -> None:
    args = parse_args()
    cfg, measured = measure_all(args)
    print_table(args, cfg.serving.ingress, measured)
    print_last_line(summary(args, cfg.serving.ingress, measured), args.smoke)


if __name__ == "__main__":
    main()
