"""Per-epoch checkpoints: model weights, optimizer state and the epoch they follow.

A checkpoint may be written in parts (one per pipeline stage, each by its own worker; Ray Train
merges the workers' directories). Parameter names are those of the whole model in every part,
so the parts' state dicts merge into the whole model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

META_FILE = "meta.json"


def _model_file(part: int) -> str:
    return f"model-part{part:03d}.pt"


def _optimizer_file(part: int) -> str:
    return f"optimizer-part{part:03d}.pt"


def save_checkpoint(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    metrics: dict,
    part: int = 0,
) -> None:
    """Write this worker's part of a checkpoint of a plain (unwrapped) model or stage."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / _model_file(part))
    torch.save(optimizer.state_dict(), directory / _optimizer_file(part))
    if part == 0:
        # One writer: Ray Train merges the parts' directories, and two meta files written into
        # the same place would corrupt each other.
        (directory / META_FILE).write_text(json.dumps({"epoch": epoch, "metrics": metrics}))


def load_model_state(directory: Path) -> dict:
    """The whole model's state dict: every part merged."""
    parts = sorted(Path(directory).glob("model-part*.pt"))
    if not parts:
        raise FileNotFoundError(f"{directory}: checkpoint holds no model-part*.pt")
    state: dict = {}
    for part in parts:
        state.update(torch.load(part, map_location="cpu", weights_only=True))
    return state


def restore_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, part: int = 0
) -> int:
    """Load this worker's part (weights and optimizer state); return the epoch to start from."""
    directory = Path(directory)
    state = torch.load(directory / _model_file(part), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    optimizer.load_state_dict(
        torch.load(directory / _optimizer_file(part), map_location="cpu", weights_only=True)
    )
    return json.loads((directory / META_FILE).read_text())["epoch"] + 1
