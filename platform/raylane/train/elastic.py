"""Runs whose worker group can change: an elastic worker count and restarts after lost nodes.

Ray Train restarts the whole worker group from the latest checkpoint when an elastic run
resizes (`parallelism.workers: {min, max}`) or a node is lost. Two things make such a run
train the same steps on the same data as a fixed-size one:

* `at_world_size`: each worker's share of the global batch is recomputed for the group's size,
  so the global batch (`training.batch_size * max`) never changes, and every worker reads the
  same global batches and takes its slice (`WholeModelReplica`), so the samples of global step
  `s` do not depend on the size either;
* step checkpoints (`training.checkpoint_every_steps`), and one more when Ray reports the node
  is being drained (`raylane.train.step_checkpoints`).

`RunProgress` keeps, beside Ray Train's checkpoints, the last global step rank 0 finished, so
a restarted group knows how many steps it has to train again (`steps_lost`) and the run keeps
a table of its worker-group sizes (`world_size_events.json`). It also names the newest
checkpoint every worker finished writing: Ray Train registers a reported checkpoint only at its
next poll of the workers, so a group that fails just after writing one would otherwise restart
from the one before (`newer_than_registered`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from raylane.config import RaylaneConfig
from raylane.train.checkpoint_files import META_FILE

EVENTS_TABLE = "world_size_events"
EVENT_COLUMNS = ["time", "global_step", "world_size", "previous_world_size", "steps_lost"]


def at_world_size(cfg: RaylaneConfig, world_size: int) -> RaylaneConfig:
    """An elastic run's config as a group of `world_size` workers runs it: `workers` is the
    group's size and each worker's batch its share of the constant global batch."""
    par = cfg.parallelism
    if not par.elastic or world_size == par.workers:
        return cfg
    global_batch = cfg.training.batch_size * par.workers
    if global_batch % world_size or not par.min_workers <= world_size <= par.workers:
        raise RuntimeError(
            f"elastic run started with {world_size} workers; its range is "
            f"{par.min_workers}-{par.workers} and its global batch {global_batch}"
        )
    tree = cfg.model_dump(mode="json")
    tree["parallelism"]["workers"] = world_size
    if tree["parallelism"]["dp"] != 1:  # ddp's dp, when given, is its workers
        tree["parallelism"]["dp"] = world_size
    tree["training"]["batch_size"] = global_batch // world_size
    return RaylaneConfig.model_validate(tree)


class RunProgress:
    """Rank 0's record of how far the run got, in a file beside its checkpoints."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.state: dict = {"global_step": 0, "world_size": None, "events": [], "checkpoint": None}
        if self.path is not None and self.path.exists():
            try:
                self.state = json.loads(self.path.read_text())
            except json.JSONDecodeError as exc:  # the run goes on; its count starts again
                print(f"raylane: {self.path} unreadable ({exc}); steps lost not counted",
                      file=sys.stderr)  # fmt: skip

    def start(self, resumed_step: int, world_size: int) -> dict:
        """A worker group starts from global step `resumed_step`: the steps it lost (trained
        after its checkpoint by the group before it) and the new row of the events table."""
        before = self.state["world_size"]
        lost = max(self.state["global_step"] - resumed_step, 0) if before else 0
        event = {
            "time": round(time.time(), 3),  # Unix seconds: the resize timeline
            "global_step": resumed_step,
            "world_size": world_size,
            "previous_world_size": before,
            "steps_lost": lost,
        }
        self.state = {
            **self.state,
            "global_step": resumed_step,
            "world_size": world_size,
            "events": [*self.state["events"], event],
        }
        self._write()
        return event

    @property
    def steps_lost(self) -> int:
        """Steps trained again over the run, all restarts together."""
        return sum(event["steps_lost"] for event in self.state["events"])

    def table(self) -> dict:
        """The events as an MLflow table (columns and rows)."""
        rows = [[event[c] for c in EVENT_COLUMNS] for event in self.state["events"]]
        return {"columns": EVENT_COLUMNS, "data": rows}

    def step_done(self, global_step: int) -> None:
        self.state["global_step"] = global_step
        self._write()

    def checkpointed(self, path: str, global_step: int) -> None:
        """Every worker has written its part of the checkpoint at `path`, after `global_step`
        optimizer steps of the run."""
        self.state["checkpoint"] = {"path": path, "global_step": global_step}
        self._write()

    def newer_than_registered(self, registered_step: int | None) -> str | None:
        """The recorded checkpoint's path when it follows more steps than the one Ray Train
        hands back (`registered_step`; None: no checkpoint) and is still on disk, else None."""
        recorded = self.state.get("checkpoint")
        if not recorded or not (Path(recorded["path"]) / META_FILE).is_file():
            return None
        if registered_step is not None and recorded["global_step"] <= registered_step:
            return None
        return recorded["path"]

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.state))
        os.replace(partial, self.path)  # a reader never sees half a file


def log_group_start(progress: RunProgress, position, world_size: int, logger) -> None:
    """As a worker group starts at `position` (a `Position`), the record's keeper (rank 0; a
    no-op elsewhere) notes its size and the steps it must train again, in the run's progress
    record and (runs that can resize or restart mid-epoch) in MLflow, at the epoch's step as
    every epoch metric."""
    resumed_step = position.global_step
    if progress.path is None:
        return
    event = progress.start(resumed_step, world_size)
    if event["steps_lost"]:
        print(
            f"raylane: restarted at global step {resumed_step} with {world_size} workers; "
            f"{event['steps_lost']} steps to train again",
            file=sys.stderr,
        )
    if logger is not None:
        logger.log({"world_size": world_size, "steps_lost": progress.steps_lost}, position.epoch)
        logger.log_tables({EVENTS_TABLE: progress.table()})


class NodeWatch:
    """While an elastic run trains: tell Ray at once when a node joins or leaves.

    Ray Train's elastic policy sizes each worker group from Ray's autoscaling coordinator
    (`ray.data._internal.cluster_autoscaler`), whose view of the nodes is refreshed every 20 s.
    A group restarted after losing a node would otherwise ask for a worker on the node that is
    gone and wait out the worker-start timeout before asking again, and a node that joins
    would wait for the next refresh before the group grows. This thread looks at the live
    nodes every `interval_s` and, when the set changes, asks the coordinator to recompute its
    view (`get_reserved_resources(recompute=True)`)."""

    COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # name, namespace

    def __init__(self, interval_s: float = 0.25):
        import threading

        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raylane-node-watch", daemon=True)

    def __enter__(self) -> NodeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        import ray

        known = None
        while not self._stop.wait(self.interval_s):
            try:
                alive = frozenset(n["NodeID"] for n in ray.nodes() if n["Alive"])
            except Exception:  # the driver is shutting down, or the GCS is away for a moment
                continue
            if known is not None and alive != known:
                self._refresh(len(alive) - len(known))
            known = alive

    def _refresh(self, change: int) -> None:
        import ray

        what = "joined" if change > 0 else "left" if change < 0 else "was replaced"
        name, namespace = self.COORDINATOR
        try:
            coordinator = ray.get_actor(name, namespace=namespace)
            ray.get(coordinator.get_reserved_resources.remote("raylane", recompute=True),
                    timeout=10)  # fmt: skip
        except Exception as exc:  # Ray's own 20 s refresh still comes; say why this did not
            print(f"raylane: a node {what}; Ray's view of the nodes was not refreshed early "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)  # fmt: skip
            return
        print(f"raylane: a node {what} ({change:+d}); Ray Train's view of the nodes refreshed",
              file=sys.stderr, flush=True)  # fmt: skip
