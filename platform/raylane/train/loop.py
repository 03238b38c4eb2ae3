"""`train_loop_per_worker`: what each Ray Train worker runs.

Strategy-agnostic: the parallelism strategy wraps the model and runs each step; this loop feeds
batches, evaluates, checkpoints, and reports once per epoch.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
import torch.distributed as dist
from torch import nn

from raylane.config import RaylaneConfig
from raylane.models import build_model
from raylane.parallel import get_strategy
from raylane.train.batches import iter_torch_batches
from raylane.train.checkpointing import restore_checkpoint, save_checkpoint


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def worker_threads(cfg: RaylaneConfig, local_world_size: int) -> int:
    """torch threads for one worker: the node's cores shared by the workers on it."""
    if cfg.parallelism.torch_threads:
        return cfg.parallelism.torch_threads
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


def _all_reduce_sum(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def _train_epoch(strategy, model, optimizer, loss_fn, shard, cfg, epoch, rank, device):
    model.train()
    loss_sum, rows = 0.0, 0
    start = time.perf_counter()
    for inputs, targets in iter_torch_batches(
        shard,
        batch_size=cfg.training.batch_size,
        features_column=cfg.data.features_column,
        label_column=cfg.data.label_column,
        shuffle_seed=cfg.training.seed * 100_003 + epoch * 1_009 + rank,
        device=device,
    ):
        loss = strategy.train_step(model, optimizer, loss_fn, inputs, targets)
        loss_sum += loss.item() * len(targets)
        rows += len(targets)
    elapsed = time.perf_counter() - start
    total_loss, total_rows = _all_reduce_sum([loss_sum, rows])
    # Throughput of the whole group: all rows over this worker's epoch time (the group moves in
    # lock-step, so every worker's epoch takes about as long).
    return total_loss / max(total_rows, 1), total_rows, elapsed


@torch.no_grad()
def _evaluate(model, loss_fn, shard, cfg, device):
    model.eval()
    loss_sum, correct, rows = 0.0, 0.0, 0.0
    for inputs, targets in iter_torch_batches(
        shard,
        batch_size=max(256, cfg.training.batch_size),
        features_column=cfg.data.features_column,
        label_column=cfg.data.label_column,
        device=device,
    ):
        logits = model(inputs)
        loss_sum += loss_fn(logits, targets).item() * len(targets)
        correct += (logits.argmax(dim=1) == targets).sum().item()
        rows += len(targets)
    loss_sum, correct, rows = _all_reduce_sum([loss_sum, correct, rows])
    return loss_sum / max(rows, 1), correct / max(rows, 1)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Train the configured model on this worker's shards, reporting once per epoch.

    `loop_config` holds the resolved config (`config`), and the MLflow run to log into
    (`tracking_uri`, `run_id`; rank 0 only).
    """
    cfg = RaylaneConfig.model_validate(loop_config["config"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    torch.set_num_threads(worker_threads(cfg, context.get_local_world_size()))
    seed_everything(cfg.training.seed)

    strategy = get_strategy(cfg.parallelism.strategy)
    model = strategy.wrap_model(build_model(cfg.model))
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.training.lr, weight_decay=cfg.training.weight_decay
    )
    loss_fn = nn.CrossEntropyLoss()

    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start_epoch = restore_checkpoint(
                Path(directory), strategy.unwrap_model(model), optimizer
            )

    epoch_logger = None
    if rank == 0 and loop_config.get("run_id"):
        from raylane.tracking.runs import EpochLogger

        epoch_logger = EpochLogger(loop_config["tracking_uri"], loop_config["run_id"])

    train_shard = ray.train.get_dataset_shard("train")
    validation_shard = ray.train.get_dataset_shard("validation")
    for epoch in range(start_epoch, cfg.training.epochs):
        train_loss, rows, elapsed = _train_epoch(
            strategy, model, optimizer, loss_fn, train_shard, cfg, epoch, rank, device
        )
        val_loss, val_accuracy = _evaluate(model, loss_fn, validation_shard, cfg, device)
        metrics = {
            "epoch": epoch,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_accuracy": val_accuracy,
            "train_samples_per_s": rows / elapsed if elapsed > 0 else 0.0,
            "epoch_time_s": elapsed,
        }
        if epoch_logger is not None:
            epoch_logger.log(metrics, step=epoch)
        with tempfile.TemporaryDirectory() as directory:
            if rank == 0:
                save_checkpoint(
                    Path(directory), strategy.unwrap_model(model), optimizer, epoch, metrics
                )
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(directory) if rank == 0 else None,
                checkpoint_dir_name=f"epoch_{epoch:04d}",
            )
