"""Spot capacity on a local multi-node Ray: an elastic run losing a node (with a drain notice,
and abruptly) and getting one back, against the same run at a fixed size.

The cluster is real: a head (`ray start --head`, no training slots) and worker nodes started
with `ray start --address` on this machine, each with its own temp dir and one logical `spot`
slot, so each node holds one training worker. Three `raylane train` runs of the digits MLP
(ddp, global batch 32, 4 epochs, step checkpoints every `--every` steps, a 50 ms straggler on
rank 0 so that a step lasts long enough to watch):

1. **fixed**: `workers: {min: 2, max: 2}` (the elastic data path at one size: the reference);
2. **notice**: `workers: {min: 1, max: 2}`; at global step 30 one node is drained with a
   deadline (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`, what a cloud's
   spot-reclaim handler calls), its raylet is stopped at the deadline, and once training goes
   on with one worker a new node joins;
3. **abrupt**: the same, but the node's raylet is killed (SIGKILL) with no notice.

From each run's progress record (`raylane_progress.json`, logged as `world_size_events.json`)
and its final checkpoint: `steps_lost_with_notice` (target 0), `steps_lost_abrupt` (target <=
`checkpoint_every_steps`), `final_loss_ratio` (last epoch's training loss, notice / fixed;
target 1 +- 0.01), `resize_s` (from Ray reporting the node gone, or a new node alive, to
the group training again at the new size, worst of the shrinks and grows, each in
`resize_s_each`; target <= 2 x the resize monitor interval + the group's restart, reported with
both; a stopped raylet is reported gone at once, a killed one only when Ray's health checks
give up on it, `node_death_detected_s`), `same_samples` (the notice run's final weights equal
the fixed run's within 1e-4: a run that trained on other samples, or on another global batch,
ends elsewhere; its per-epoch losses are compared too). The last line is one JSON object.

    python benchmarks/elastic.py [--every 5] [--strategy fsdp]

`--strategy fsdp` runs the same three with FSDP2 (each resize loads the sharded checkpoint
re-sharded over the new group).

Takes about 6 minutes. It stops every Ray on this machine first and last (`ray stop`). The
cluster's clients authenticate with a token of this run's own (RAY_AUTH_TOKEN_PATH), whether or
not ~/.ray/auth_token exists. `--smoke` trains 2 epochs and loses the node at step 10.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harness import add_smoke_flag, free_port, print_last_line

from raylane.train.checkpointing import load_model_state

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MONITOR_S = 2.0
DRAIN_AT_STEP = {"full": 30, "smoke": 10}
EPOCHS = {"full": 4, "smoke": 2}
DEADLINE_S = 3
ENV = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5", "RAY_DEDUP_LOGS": "0"}


class LocalCluster:
    """A head and `spot` nodes as separate raylets on this machine."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {**os.environ, **ENV}
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.started = 0
        subprocess.run(
            [BIN / "ray", "start", "--head", f"--port={self.address.split(':')[1]}",
             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
             f"--temp-dir={root / 'head'}"],
            check=True, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def add_node(self) -> str:
        self.started += 1
        name = f"node{self.started}"
        ports = [
            f"--{option}={free_port()}"
            for option in ("node-manager-port", "object-manager-port", "metrics-export-port",
                           "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                           "runtime-env-agent-port")
        ]  # fmt: skip
        self.nodes[name] = subprocess.Popen(
            [BIN / "ray", "start", f"--address={self.address}", "--num-cpus=1",
             '--resources={"spot": 1}', "--disable-usage-stats", "--block",
             f"--temp-dir={self.root / name}", *ports],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return name

    def node_id(self, name: str) -> str:
        found = self._alive_id(name)
        if found is None:
            raise LookupError(f"node {name} is not alive")
        return found

    def _alive_id(self, name: str) -> str | None:
        import ray

        prefix = str(self.root / name) + "/"
        for node in ray.nodes():
            if node["Alive"] and node["ObjectStoreSocketName"].startswith(prefix):
                return node["NodeID"]
        return None

    def wait_alive(self, count: int) -> None:
        import ray

        _until(lambda: sum(node["Alive"] for node in ray.nodes()) == count,
               f"the cluster did not reach {count} nodes", timeout_s=60.0, every_s=0.3)  # fmt: skip

    def wait_dead(self, node_id: str) -> float:
        """When Ray first reports `node_id` dead (a stopped raylet says so as it leaves; a
        killed one is found by Ray's health checks, by default five missed checks 3 s apart)."""
        import ray

        return _until(
            lambda: not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()),
            f"Ray still reports node {node_id} alive",
        )

    def wait_joined(self, name: str) -> float:
        """When Ray first reports the node `name` alive (its raylet registered)."""
        return _until(lambda: self._alive_id(name) is not None, f"node {name} did not join")

    def drain(self, name: str, deadline_s: int) -> None:
        subprocess.run(
            [BIN / "ray", "drain-node", f"--address={self.address}",
             f"--node-id={self.node_id(name)}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
             "--reason-message=spot capacity reclaimed",
             f"--deadline-remaining-seconds={deadline_s}"],
            check=True, env=self.env, capture_output=True,
        )  # fmt: skip

    def stop_node(self, name: str, abrupt: bool) -> None:
        process = self.nodes.pop(name)
        if abrupt:  # the raylet and its workers vanish at once, as a reclaimed VM does
            node_dir = str(self.root / name)
            for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True,
                                       text=True).stdout.splitlines():  # fmt: skip
                pid, _, args = line.strip().partition(" ")
                if node_dir in args and pid.isdigit():
                    os.kill(int(pid), signal.SIGKILL)
        process.terminate()
        process.wait(timeout=60)


def _until(condition, failure: str, timeout_s: float = 120.0, every_s: float = 0.1) -> float:
    """Poll `condition` until it holds; the time it first did (TimeoutError `failure` after
    `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(failure)
        time.sleep(every_s)
    return time.time()


def _progress(storage: Path) -> dict | None:
    found = list(storage.glob("*/raylane_progress.json"))
    return json.loads(found[0].read_text()) if found else None


def _wait_for(storage: Path, train: subprocess.Popen, ready, timeout_s: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = _progress(storage)
        if state is not None and ready(state):
            return state
        if train.poll() is not None:
            raise RuntimeError(f"the run ended (exit {train.returncode}) before the event")
        time.sleep(0.1)
    raise TimeoutError("the run did not reach the event")


def _train(cluster, work: Path, name: str, workers: str, every: int, strategy, smoke: bool):
    storage = work / name
    overrides = {
        "parallelism.strategy": strategy,
        "parallelism.workers": workers,
        "parallelism.resources_per_worker": "{CPU: 0.5, spot: 1}",
        "parallelism.elastic_resize_monitor_s": MONITOR_S,
        "parallelism.straggler": "{rank: 0, delay_s: 0.05}",
        "training.batch_size": 16,
        "training.epochs": EPOCHS["smoke" if smoke else "full"],
        "training.checkpoint_every_steps": every,
        "training.max_failures": 3,  # a node lost without notice is a worker failure
        "training.storage_path": storage,
        "tracking.tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
    }
    command = [BIN / "raylane", "train", "--config", ROOT / "configs/train/digits_ddp.yaml"]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    log = open(work / f"{name}.log", "w")  # noqa: SIM115 - the run's console, kept
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    process = subprocess.Popen([str(c) for c in command], env=env, stdout=log, stderr=log)
    return process, storage


def _run(cluster, work, name, args, disruption: str | None) -> dict:
    """One run; with a disruption ('notice' or 'abrupt'), lose a node at step 30 and add a
    new one once one worker trains on. The run's events and the wall times of what was done."""
    workers = "{min: 1, max: 2}" if disruption else "{min: 2, max: 2}"
    train, storage = _train(cluster, work, name, workers, args.every, args.strategy, args.smoke)
    drain_at = DRAIN_AT_STEP["smoke" if args.smoke else "full"]
    marks: dict[str, float] = {}
    victim = sorted(cluster.nodes)[0]
    if disruption:
        at = _wait_for(storage, train, lambda s: s["global_step"] >= drain_at)
        marks["step_at_loss"] = at["global_step"]
        victim_id = cluster.node_id(victim)  # before a drain: Ray may end the node at its deadline
        if disruption == "notice":
            cluster.drain(victim, DEADLINE_S)
            marks["drained"] = time.time()
            time.sleep(DEADLINE_S)
        marks["node_left"] = time.time()
        cluster.stop_node(victim, abrupt=disruption == "abrupt")
        marks["node_dead"] = cluster.wait_dead(victim_id)
        _wait_for(storage, train, lambda s: s["world_size"] == 1)
        joining = cluster.add_node()
        marks["node_added"] = time.time()
        marks["node_joined"] = cluster.wait_joined(joining)
    if train.wait(timeout=600):
        raise RuntimeError(f"{name}: raylane train failed; see {work / name}.log")
    run_name = next(storage.glob("*/raylane_progress.json")).parent.name
    events = _progress(storage)["events"]
    return {"events": events, "marks": marks, "storage": str(storage), "run_name": run_name}


def _final_state(run: dict, tracking_uri: str) -> tuple[dict, list[float]]:
    """The run's final weights (its last checkpoint) and its epochs' training losses (MLflow)."""
    import torch
    from mlflow.tracking import MlflowClient

    run_dir = Path(run["storage"]).joinpath(run["run_name"])
    final = sorted(p for p in run_dir.glob("epoch_*") if "_step_" not in p.name)[-1]
    client = MlflowClient(tracking_uri)
    found = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"attributes.run_name = '{run['run_name']}'",
    )[0]
    history = sorted(client.get_metric_history(found.info.run_id, "train_loss"),
                     key=lambda m: m.timestamp)  # fmt: skip
    losses = {int(m.step): m.value for m in history}  # the last value logged per epoch
    weights = {k: v.to(torch.float64) for k, v in load_model_state(final).items()}
    return weights, [losses[e] for e in sorted(losses)]


def _resize_seconds(run: dict) -> list[float]:
    """Ray reports the node dead -> the group starts at one worker; Ray reports the new node
    alive -> at two (when it grew before the run ended)."""
    events, marks = run["events"], run["marks"]
    shrink = next(e for e in events if e["world_size"] == 1)
    grow = [e for e in events if e["previous_world_size"] == 1]
    seconds = [shrink["time"] - marks.get("node_dead", marks["node_left"])]
    joined = marks.get("node_joined", marks["node_added"])
    return seconds + [grow[0]["time"] - joined] if grow else seconds


def _detection_seconds(run: dict) -> float | None:
    """Node stopped or killed -> Ray reports it dead (runs from before this mark: None)."""
    marks = run["marks"]
    return marks["node_dead"] - marks["node_left"] if "node_dead" in marks else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=5, help="training.checkpoint_every_steps")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--figures-from", type=Path, help="a finished run's work dir: figures only")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.figures_from is not None:
        runs = json.loads((args.figures_from / "runs.json").read_text())
        uri = f"sqlite:///{args.figures_from / 'mlflow.db'}"
        figures = _figures(runs, args.every, uri, runs.get("strategy", "ddp"))
        print_last_line(figures, runs.get("smoke", False))
        return
    subprocess.run([BIN / "ray", "stop", "--force"], capture_output=True)
    work = Path(tempfile.mkdtemp(prefix="raylane-elastic-"))
    token = work / "auth_token"  # Ray reads these when it is imported: below
    token.write_text(uuid.uuid4().hex)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    os.environ.pop("RAY_ADDRESS", None)  # this benchmark's own cluster, never another
    cluster = LocalCluster(work / "nodes")
    import ray

    try:
        cluster.add_node()
        cluster.add_node()
        ray.init(address=cluster.address, logging_level="ERROR")
        cluster.wait_alive(3)
        runs = {name: _run(cluster, work, name, args, disruption)
                for name, disruption in (("fixed", None), ("notice", "notice"),
                                         ("abrupt", "abrupt"))}  # fmt: skip
    finally:
        ray.shutdown()
        subprocess.run([BIN / "ray", "stop", "--force"], capture_output=True)
    saved = {**runs, "strategy": args.strategy, "smoke": args.smoke}
    (work / "runs.json").write_text(json.dumps(saved))
    figures = _figures(runs, args.every, f"sqlite:///{work / 'mlflow.db'}", args.strategy)
    print_last_line(figures, args.smoke)


def _figures(runs: dict, every: int, tracking_uri: str, strategy: str = "ddp") -> dict:
    fixed_w, fixed_losses = _final_state(runs["fixed"], tracking_uri)
    notice_w, notice_losses = _final_state(runs["notice"], tracking_uri)
    weight_gap = max((fixed_w[k] - notice_w[k]).abs().max().item() for k in fixed_w)
    loss_gap = max(abs(a - b) / abs(a) for a, b in zip(fixed_losses, notice_losses, strict=True))
    for name in ("notice", "abrupt"):
        run = runs[name]
        print(f"{name}: step at loss {run['marks']['step_at_loss']}")
        for event in run["events"]:
            print(f"  {event}")
        print(f"  resize s (shrink, grow): {_resize_seconds(run)}; Ray saw the node dead "
              f"after {_detection_seconds(run)} s")  # fmt: skip
    shrink = {n: next(e for e in runs[n]["events"] if e["world_size"] == 1)
              for n in ("notice", "abrupt")}  # fmt: skip
    grow = [e for n in shrink for e in runs[n]["events"] if e["previous_world_size"] == 1]
    print(f"epoch losses fixed {fixed_losses}\n             notice {notice_losses}")
    return {
        "strategy": strategy,
        "checkpoint_every_steps": every,
        "steps_lost_with_notice": shrink["notice"]["steps_lost"],
        "steps_lost_abrupt": shrink["abrupt"]["steps_lost"],
        "steps_lost_on_grow": max((g["steps_lost"] for g in grow), default=None),
        "final_loss_ratio": round(notice_losses[-1] / fixed_losses[-1], 6),
        "epoch_loss_max_rel_gap": loss_gap,
        "final_weight_max_abs_gap": weight_gap,
        "same_samples": weight_gap < 1e-4 and loss_gap < 1e-4,
        "resize_s": round(max(max(_resize_seconds(runs[n])) for n in shrink), 2),
        "resize_s_each": {n: [round(x, 2) for x in _resize_seconds(runs[n])] for n in shrink},
        "node_death_detected_s": {n: _round(_detection_seconds(runs[n])) for n in shrink},
        "resize_monitor_s": MONITOR_S,
        "world_sizes": {
            n: [e["world_size"] for e in runs[n]["events"]] for n in ("fixed", *shrink)
        },
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


if __name__ == "__main__":
    main()
