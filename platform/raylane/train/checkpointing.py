"""Checkpoints: model weights, optimizer state and where training stands (the epoch they
follow, or for a step checkpoint inside an epoch, the epoch, the steps of it done and the
group's loss so far).

One format for every layout: a torch distributed checkpoint (`sharded/`), which every worker
writes collectively (its shards of a split or sharded model; of a replicated one, DCP keeps one
copy), with the optimizer state keyed by parameter name. It resumes on its own layout and,
re-sharded by DCP, on another worker count (an elastic group that shrank or grew).
Beside it, the workers with `writes_part` write the assembled model as `model-partNNN.pt`
(one part per pipeline stage, in the whole model's parameter names, so the parts merge): what
registration, serving and fine-tuning load. Ray Train merges the workers' directories.

Checkpoints written before DCP was the one format (`model-partNNN.pt` and
`optimizer-partNNN.pt` alone) still resume: `restore` reads each worker's part of them.
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


def restore(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plain: nn.Module,
    part: int,
    with_optimizer: bool = True,
) -> Position:
    """Collective: load checkpoint `directory` into this worker's `model` (its shards, its
    stage) and, `with_optimizer`, `optimizer`; where training continues. `plain` is `model`
    unwrapped and `part` its part number, for a checkpoint written before DCP was the one
    format."""
    directory = Path(directory)
    if (directory / SHARDED_DIR / ".metadata").is_file():
        return restore_sharded_checkpoint(directory, model, optimizer, with_optimizer)
    if any(_split(p) for p in model.parameters()):
        raise ValueError(
            f"checkpoint {directory} holds no sharded state ({SHARDED_DIR}/.metadata): it was "
            "saved by a layout that does not split the model; resume it with that layout"
        )
    return restore_parts(directory, plain, optimizer, part)


def _split(param: torch.Tensor) -> bool:
    """Whether this worker holds a part of `param` only (a DTensor sharded on some dimension
    of its mesh); a replicated one (FSDP2's `replicate`) is whole on every worker."""
    placements = getattr(param, "placements", None)
    return placements is not None and any(not p.is_replicate() for p in placements)


def restore_parts(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, part: int = 0
) -> Position:
    """An earlier checkpoint's part `part` (`model-partNNN.pt` and `optimizer-partNNN.pt`,
    whole-model replicas' and pipeline stages' format before DCP) into `model`: a plain one,
    or one whose parameters are replicated DTensors (a pipeline stage's replicas now)."""
    model_file, optimizer_file = directory / _model_file(part), directory / _optimizer_file(part)
    if not optimizer_file.is_file():
        raise FileNotFoundError(
            f"checkpoint {directory} holds neither a distributed checkpoint "
            f"({SHARDED_DIR}/.metadata) nor the parts {model_file.name} and "
            f"{optimizer_file.name}"
        )
    weights = torch.load(model_file, map_location="cpu", weights_only=True)
    moments = torch.load(optimizer_file, map_location="cpu", weights_only=True)
    with kernel_choice_kept(optimizer):
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            _load_whole_state(model, optimizer, weights, moments)
        else:
            model.load_state_dict(weights)
            optimizer.load_state_dict(moments)
    return resume_position(directory)


def _load_whole_state(model, optimizer, weights: dict, moments: dict) -> None:
    """Whole tensors (a part file's) into a model of replicated DTensors and its optimizer, by
    torch's full-state-dict loaders; the optimizer's state, saved by parameter index, keyed by
    parameter name in the order the optimizer holds them (a parameter without state, one
    that never had a gradient, keeps its zero state)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    if not moments["state"]:  # plain SGD keeps none (torch's loader needs a tensor in it)
        return
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name = {
        "state": {names[index]: state for index, state in moments["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in moments["param_groups"]
        ],
    }
    whole_and_partial = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, optimizer, by_name, options=whole_and_partial)


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


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool) -> dict:
    """What DCP writes and loads: the model's state dict and, `with_optimizer`, the optimizer's
    (keyed by parameter name). An optimizer without state (a fresh one after a backward) gets
    torch's zero state first, the keys a load fills: torch makes it only where no gradient is
    set. Without the optimizer: a strategy whose parameters a server updates."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not with_optimizer:
        return {"model": get_model_state_dict(model)}
    if not optimizer.state:
        optimizer.zero_grad(set_to_none=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat_options())
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded_checkpoint(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    metrics: dict,
    part: int = 0,
    writes_part: bool = False,
    *,
    with_optimizer: bool = True,
    lowest_rank: bool = False,
) -> None:
    """Collective: every worker writes its shards; the workers with `writes_part` also their
    part (or the whole) of the assembled model and, for part 0, the checkpoint's metadata.
    A tensor several workers hold goes to the one DCP balances the bytes onto, or with
    `lowest_rank` to the lowest of them (replicas whose optimizer states differ: rank 0's
    whole, as its assembled model is)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(
        _state(model, optimizer, with_optimizer),
        checkpoint_id=directory / SHARDED_DIR,
        planner=DefaultSavePlanner(dedup_save_to_lowest_rank=lowest_rank),
    )
    # Assembled on every worker of the group (pipeline stages hold different parts), in the
    # plain model's names.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if writes_part:
        torch.save({k: v.cpu() for k, v in full.items()}, directory / _model_file(part))
        if part == 0:
            _write_meta(directory, epoch, metrics)


def restore_sharded_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer=True
) -> Position:
    """Collective: load every worker's shards of the model and, `with_optimizer`, of the
    optimizer from the checkpoint's DCP directory; where training continues. Every model
    tensor must be there; optimizer state is absent for a parameter that never had a gradient
    (it keeps its zero state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _state(model, optimizer, with_optimizer)
    stored = dcp.FileSystemReader(str(directory / SHARDED_DIR)).read_metadata()
    missing = [k for k in state["model"] if f"model.{k}" not in stored.state_dict_metadata]
    if missing:
        raise ValueError(
            f"checkpoint {directory} holds no {missing[0]!r} ({len(missing)} of the model's "
            f"{len(state['model'])} entries missing): it was saved from another model"
        )
    dcp.load(
        state,
        checkpoint_id=directory / SHARDED_DIR,
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    if not with_optimizer:
        set_model_state_dict(model, state["model"])
        return resume_position(directory)
    with kernel_choice_kept(optimizer):
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_flat_options(),
        )
    return resume_position(directory)


def save_epoch_checkpoint(directory: Path, strategy, model, optimizer, epoch: int, metrics) -> None:
    """Collective: this worker's part of epoch `epoch`'s checkpoint (its DCP shards, and the
    assembled part where its strategy `writes_part`): the optimizer state where the strategy
    steps it, rank 0's copy of what replicas hold where their states may differ."""
    save_sharded_checkpoint(
        directory, model, optimizer, epoch, metrics, strategy.checkpoint_part,
        strategy.writes_part, with_optimizer=strategy.steps_optimizer,
        lowest_rank=not strategy.replicas_agree,
    )  # fmt: skip


def save_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, metrics
) -> None:
    """A checkpoint of one process's whole model (outside a process group of several)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("save_checkpoint is one process's; a group saves collectively")
    save_sharded_checkpoint(directory, model, optimizer, epoch, metrics, writes_part=True)
