"""Checkpoints inside an epoch (`training.checkpoint_every_steps`).

Every `every` optimizer steps the group writes a checkpoint as at an epoch's end (every worker
its part of the distributed checkpoint) and reports it to Ray Train, which keeps the newest
`training.checkpoints_to_keep` of all and hands the latest back after a worker-group failure.
Its metadata says where training stands: the epoch, the steps of it done, and the group's
training-loss sum and row count so far, so the epoch's reported loss is still over all its
steps. A run continuing from it reads the epoch's batches in the same order (the shuffle is
seeded by the epoch), skips the ones already trained on and goes on from the next: the same
steps on the same data, as if it had never stopped.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import ray.train
import torch.distributed as dist

from raylane.parallel.device import all_reduce_scalars
from raylane.train.checkpointing import Position, resume_position, save_epoch_checkpoint
from raylane.train.elastic import RunProgress, log_group_start
from raylane.train.worker_spec import WorkerSpec


class StepCheckpoints:
    """What happens between two steps of a run that may lose its nodes: the step checkpoints
    (a no-op when they are off), the global step count, rank 0's progress record, and the
    reaction to a drain notice.

    With `training.checkpoint_every_steps` set, every worker asks Ray Train before each step
    whether a node of the group is being drained (`ray.train.get_preemption_info`, a barrier of
    the group). On a notice the group checkpoints after the step it just finished and then
    waits: Ray Train ends the group at the deadline and restarts it from that checkpoint
    without the drained node, so no step is trained twice."""

    def __init__(
        self, cfg, strategy, model, optimizer, position: Position, spec: WorkerSpec, logger
    ):
        """Also, on rank 0, records the group's start (`raylane.train.elastic`)."""
        self.every = cfg.training.checkpoint_every_steps
        self.elastic = cfg.parallelism.elastic
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.global_step = position.global_step
        # Rank 0 keeps the record, beside the checkpoints (shared storage on a multi-node
        # cluster, as Ray Train's checkpoints need).
        self.recorded = records_progress(cfg)  # the same on every rank
        keeps = self.recorded and dist.get_rank() == 0
        self.progress = RunProgress(spec.progress_path if keeps else None)
        log_group_start(self.progress, position, dist.get_world_size(), logger)

    def epoch_metrics(self) -> dict[str, int]:
        """The run's optimizer steps so far, and an elastic run's worker count."""
        size = {"world_size": dist.get_world_size()} if self.elastic else {}
        return {"global_step": self.global_step, **size}

    def due(self, steps_done: int) -> bool:
        """Whether a checkpoint follows the first `steps_done` steps of an epoch (asked
        before the next step, so the epoch's last step is left to the epoch's checkpoint)."""
        return self.every is not None and steps_done > 0 and steps_done % self.every == 0

    def between_steps(self, epoch: int, steps_done: int, skip: int, loss_sum, rows) -> bool:
        """Before step `steps_done` of `epoch` (the first `skip` came from a checkpoint):
        checkpoint when due or on a drain notice; whether a checkpoint was written."""
        if steps_done < skip:
            return False
        notice = self.every is not None and ray.train.get_preemption_info()
        wrote = steps_done > skip and (self.due(steps_done) or bool(notice))
        if wrote:
            self.save(epoch, steps_done, loss_sum, rows)
        if notice:
            self._wait_for_restart(notice)
        return wrote

    def step_done(self) -> None:
        """One more optimizer step trained (rank 0 records it)."""
        self.global_step += 1
        self.progress.step_done(self.global_step)

    def save(self, epoch: int, steps_done: int, loss_sum, rows: float) -> None:
        """Collective: checkpoint after `steps_done` steps of `epoch`; `loss_sum` (a number,
        or a tensor on the loss's device) and `rows` are this worker's training loss sum and
        rows in the epoch so far, summed over the group on its collective device."""
        total_loss, total_rows = all_reduce_scalars([loss_sum, rows])
        position = {"step": steps_done, "loss_sum": total_loss, "rows": round(total_rows)}
        metrics = {"epoch": epoch, "global_step": self.global_step, **position}
        self.report(epoch, metrics, f"epoch_{epoch:04d}_step_{steps_done:06d}")

    def report(self, epoch: int, metrics: dict, name: str, extra: dict | None = None) -> None:
        """Collective: write this worker's part of checkpoint `name` (`metrics` in its
        metadata) and report it to Ray Train with `metrics` and `extra`. A run that keeps a
        progress record then waits for every worker's part and records the checkpoint as
        complete, so a restart can take it even before Ray Train has registered it."""
        with tempfile.TemporaryDirectory() as directory:
            save_epoch_checkpoint(
                Path(directory), self.strategy, self.model, self.optimizer, epoch, metrics
            )
            ray.train.report(
                {**metrics, **(extra or {})},
                checkpoint=ray.train.Checkpoint.from_directory(directory),
                checkpoint_dir_name=name,
            )
        if self.recorded:
            dist.barrier()  # every part is in storage (report returns after its upload)
            if self.progress.path is not None:
                self.progress.checkpointed(str(self.progress.path.parent / name), self.global_step)

    def _wait_for_restart(self, notice) -> None:
        """Hold the group after its notice checkpoint until Ray Train ends it (a step trained
        now would be lost with the node)."""
        deadline = notice.deadline_ms / 1000 - time.time() if notice.deadline_ms else None
        if dist.get_rank() == 0:
            when = f"in {deadline:.0f} s" if deadline is not None else "without a deadline"
            print(
                f"raylane: node(s) {', '.join(n[:12] for n in notice.preempted_node_ids)} "
                f"drained {when}; checkpointed after global step {self.global_step}, waiting "
                "for Ray Train to restart the group without them",
                file=sys.stderr,
                flush=True,
            )
        while True:
            time.sleep(1.0)


def records_progress(cfg) -> bool:
    """Whether the run keeps a progress record: runs that checkpoint inside epochs or resize."""
    return cfg.training.checkpoint_every_steps is not None or cfg.parallelism.elastic


def restore_point(cfg, spec: WorkerSpec) -> ray.train.Checkpoint | None:
    """Collective: the checkpoint a worker group starts from. Ray Train's latest registered
    one, unless the run's progress record names a newer complete one: Ray Train registers a
    checkpoint at its next poll of the workers, and a group that failed in between would
    otherwise train the steps since it again."""
    checkpoint = ray.train.get_checkpoint()
    if not records_progress(cfg):
        return checkpoint
    newer: list[str | None] = [None]
    if dist.get_rank() == 0:  # the record's keeper decides for the group
        registered = None
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                registered = resume_position(Path(directory)).global_step
        newer[0] = RunProgress(spec.progress_path).newer_than_registered(registered)
        if newer[0] is not None:
            print(f"raylane: restarting from {newer[0]}, written by every worker but not yet "
                  "registered by Ray Train", file=sys.stderr, flush=True)  # fmt: skip
    dist.broadcast_object_list(newer, src=0)
    return ray.train.Checkpoint(newer[0]) if newer[0] is not None else checkpoint


def epoch_start(position: Position, epoch: int) -> tuple[int, float, int]:
    """`(steps to skip, loss sum, rows)` an epoch starts from: where a step checkpoint left
    `position.epoch` (its sums carried by rank 0 alone, so the group's sum counts them once),
    else nothing."""
    if epoch != position.epoch or not position.step:
        return 0, 0.0, 0
    if dist.get_rank() != 0:
        return position.step, 0.0, 0
    return position.step, position.loss_sum, position.rows
