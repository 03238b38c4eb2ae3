"""Checkpoints inside an epoch (`training.checkpoint_every_steps`).

Every `every` optimizer steps the group writes a checkpoint as at an epoch's end (each worker
its part, or its shards) and reports it to Ray Train, which keeps the newest
`training.checkpoints_to_keep` of all and hands the latest back after a worker-group failure.
Its metadata says where training stands: the epoch, the steps of it done, and the group's
training-loss sum and row count so far, so the epoch's reported loss is still over all its
steps. A run continuing from it reads the epoch's batches in the same order (the shuffle is
seeded by the epoch), skips the ones already trained on and goes on from the next: the same
steps on the same data, as if it had never stopped.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import ray.train
import torch
import torch.distributed as dist

from raylane.train.checkpointing import Position, save_epoch_checkpoint


class StepCheckpoints:
    """Writes the step checkpoints of one worker's run; a no-op when they are off."""

    def __init__(self, every: int | None, strategy, model, optimizer):
        self.every = every
        self.strategy, self.model, self.optimizer = strategy, model, optimizer

    def due(self, steps_done: int) -> bool:
        """Whether a checkpoint follows the first `steps_done` steps of an epoch (asked
        before the next step, so the epoch's last step is left to the epoch's checkpoint)."""
        return self.every is not None and steps_done > 0 and steps_done % self.every == 0

    def save(self, epoch: int, steps_done: int, loss_sum: float, rows: int) -> None:
        """Collective: checkpoint after `steps_done` steps of `epoch`; `loss_sum` and `rows`
        are this worker's training loss sum and rows in the epoch so far."""
        totals = torch.tensor([loss_sum, float(rows)], dtype=torch.float64)
        dist.all_reduce(totals)
        position = {
            "step": steps_done,
            "loss_sum": float(totals[0]),
            "rows": round(totals[1].item()),
        }
        metrics = {"epoch": epoch, **position}
        with tempfile.TemporaryDirectory() as directory:
            wrote = save_epoch_checkpoint(
                Path(directory), self.strategy, self.model, self.optimizer, epoch, metrics
            )
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(directory) if wrote else None,
                checkpoint_dir_name=f"epoch_{epoch:04d}_step_{steps_done:06d}",
            )


def epoch_start(position: Position, epoch: int) -> tuple[int, float, int]:
    """`(steps to skip, loss sum, rows)` an epoch starts from: where a step checkpoint left
    `position.epoch` (its sums carried by rank 0 alone, so the group's sum counts them once),
    else nothing."""
    if epoch != position.epoch or not position.step:
        return 0, 0.0, 0
    if dist.get_rank() != 0:
        return position.step, 0.0, 0
    return position.step, position.loss_sum, position.rows
