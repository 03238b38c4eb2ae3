"""Checkpoints: model weights, optimizer state and where training stands (the epoch they
follow, or for a step checkpoint inside an epoch, the epoch, the steps of it done and the
group's loss so far).

A checkpoint may be written in parts (one per pipeline stage, each by its own worker; Ray Train
merges the workers' directories). Parameter names are those of the whole model in every part,
so the parts' state dicts merge into the whole model's.

Strategies whose parameters are sharded (tp, fsdp) write a torch distributed checkpoint instead
(`sharded/`: every worker its shards of the model and optimizer, resumable on the same layout)
and, from rank 0, the assembled model as part 0, which is what registration and serving load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raylane.models.optim import kernel_choice_kept
from raylane.train.checkpoint_files import META_FILE, SHARDED_DIR


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
        _write_meta(directory, epoch, metrics)


def load_model_state(directory: Path) -> dict:
    """The whole model's state dict: every part merged."""
    parts = sorted(Path(directory).glob("model-part*.pt"))
    if not parts:
        raise FileNotFoundError(f"{directory}: checkpoint holds no model-part*.pt")
    state: dict = {}
    for part in parts:
        state.update(torch.load(part, map_location="cpu", weights_only=True))
    return state


@dataclass(frozen=True)
class Position:
    """Where training continues: `epoch`, after `step` of its steps (0: from its start), with
    the group's training loss sum and row count over those steps."""

    epoch: int
    step: int = 0
    loss_sum: float = 0.0
    rows: int = 0
    #: Optimizer steps of the run before this point, all epochs together.
    global_step: int = 0


def resume_position(directory: Path) -> Position:
    """Where training continues after checkpoint `directory`."""
    meta = json.loads((Path(directory) / META_FILE).read_text())
    global_step = meta.get("global_step", 0)
    if "step" not in meta:  # an epoch checkpoint: the next epoch from its start
        return Position(meta["epoch"] + 1, global_step=global_step)
    return Position(meta["epoch"], meta["step"], meta["loss_sum"], meta["rows"], global_step)


def restore_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, part: int = 0
) -> Position:
    """Load this worker's part (weights and optimizer state); where training continues."""
    directory = Path(directory)
    state = torch.load(directory / _model_file(part), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    with kernel_choice_kept(optimizer):
        optimizer.load_state_dict(
            torch.load(directory / _optimizer_file(part), map_location="cpu", weights_only=True)
        )
    return resume_position(directory)


def _write_meta(directory: Path, epoch: int, metrics: dict) -> None:
    """`metrics` of a step checkpoint hold `step`, `loss_sum` and `rows`, and every
    checkpoint's the run's `global_step` (`Position`)."""
    meta = {"epoch": epoch, "metrics": metrics}
    meta |= {k: metrics[k] for k in ("step", "loss_sum", "rows", "global_step") if k in metrics}
    (directory / META_FILE).write_text(json.dumps(meta))


def _flat_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer settings keyed by parameter name: pipeline stages hold different parameters,
    # and one shared `param_groups` entry would be written by one of them only.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_sharded_checkpoint(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    metrics: dict,
    part: int = 0,
    writes_part: bool = False,
) -> None:
    """Collective: every worker writes its shards; the workers with `writes_part` also their
    part (or the whole) of the assembled model, as `save_checkpoint` would."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    directory.mkdir(parents=True, exist_ok=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat_options())
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=directory / SHARDED_DIR,
    )
    # Assembled on every worker of the group (pipeline stages hold different parts), in the
    # plain model's names.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if writes_part:
        torch.save({k: v.cpu() for k, v in full.items()}, directory / _model_file(part))
        if part == 0:
            _write_meta(directory, epoch, metrics)


def restore_sharded_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Position:
    """Collective: load every worker's shards of model and optimizer; where training
    continues."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    if not (directory / SHARDED_DIR / ".metadata").is_file():
        raise ValueError(
            f"checkpoint {directory} holds no sharded state ({SHARDED_DIR}/.metadata): it was "
            "saved by a strategy that does not shard the model; resume it with that strategy"
        )
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat_options())
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory / SHARDED_DIR)
    with kernel_choice_kept(optimizer):
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_flat_options(),
        )
    return resume_position(directory)


def save_epoch_checkpoint(directory: Path, strategy, model, optimizer, epoch: int, metrics) -> bool:
    """This worker's part of epoch `epoch`'s checkpoint, as its strategy writes checkpoints;
    whether it reports one (a sharded checkpoint needs every worker's files, otherwise only
    the writers')."""
    if strategy.sharded_checkpoint:
        save_sharded_checkpoint(
            directory, model, optimizer, epoch, metrics, strategy.checkpoint_part,
            strategy.writes_part,
        )  # fmt: skip
        return True
    if strategy.saves_checkpoint:
        save_checkpoint(
            directory, strategy.unwrap_model(model), optimizer, epoch, metrics,
            strategy.checkpoint_part,
        )  # fmt: skip
        return True
    return False
