"""Per-epoch checkpoints: model weights, optimizer state and the epoch they follow."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"


def save_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, metrics: dict
) -> None:
    """Write a checkpoint of a plain (unwrapped) model into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / MODEL_FILE)
    torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    (directory / META_FILE).write_text(json.dumps({"epoch": epoch, "metrics": metrics}))


def load_model_state(directory: Path) -> dict:
    return torch.load(Path(directory) / MODEL_FILE, map_location="cpu", weights_only=True)


def restore_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load weights and optimizer state; return the epoch to start from."""
    directory = Path(directory)
    model.load_state_dict(load_model_state(directory))
    optimizer.load_state_dict(
        torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    )
    return json.loads((directory / META_FILE).read_text())["epoch"] + 1
