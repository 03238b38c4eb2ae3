"""A user's own torch module (`model.kind: custom`): built by the function `model.factory`
names, called with `model.args`, and checked before Ray starts.

The factory returns an `nn.Module`, or a pair `(module, loss_fn)` whose `loss_fn(outputs,
labels)` is the scalar training loss (without one, raylane's cross-entropy). The module is
marked with the class name of its repeated blocks (`BLOCK_CLASS_ATTRIBUTE`: `model.block_class`,
else found by `repeated_block_class`), which `raylane.parallel.parallelize` shards, checkpoints
and compiles one at a time; a `tp_plan` attribute on it names its tensor-parallel plan, as
raylane's GPT's does.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from raylane.config import ConfigError, ModelConfig, RaylaneConfig
from raylane.config.model import import_factory, one_line

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The attribute that tells `raylane.parallel.parallelize` which class a model's blocks are
#: (its `BLOCK_CLASS_ATTRIBUTE`, the same name: that module imports torch alone).
BLOCK_CLASS_ATTRIBUTE = "raylane_block_class"

#: Configurations `check_custom_model` passed in this process (the command line's preflight and
#: the job's both ask).
_checked: set[str] = set()


def build_custom(cfg: ModelConfig) -> tuple[nn.Module, LossFn | None]:
    """The factory's module (marked with its block class) and its loss function, or None."""
    try:
        factory = import_factory(cfg.factory)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        made = factory(**cfg.args)
    except Exception as exc:  # noqa: BLE001 - the user's factory failed: say so in one line
        raise ConfigError(f"model.factory: {_call(cfg)} raised {one_line(exc)}") from None
    model, loss_fn = _unpack(made, cfg)
    block_class = cfg.block_class or repeated_block_class(model)
    if block_class is not None:
        setattr(model, BLOCK_CLASS_ATTRIBUTE, block_class)
    return model, loss_fn


def _call(cfg: ModelConfig) -> str:
    arguments = ", ".join(f"{k}={v!r}" for k, v in cfg.args.items())
    return f"{cfg.factory}({arguments})"


def _unpack(made: object, cfg: ModelConfig) -> tuple[nn.Module, LossFn | None]:
    """`made` as (module, loss_fn or None); ConfigError naming what it was otherwise."""
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple | list) and len(made) == 2 and isinstance(made[0], nn.Module):
        if not callable(made[1]):
            raise ConfigError(
                f"model.factory: {cfg.factory} returned ({type(made[0]).__name__}, "
                f"{type(made[1]).__name__}): the second item must be loss_fn(outputs, labels)"
            )
        return made[0], made[1]
    what = type(made).__name__
    if isinstance(made, tuple | list):
        what = f"a {what} of {', '.join(type(item).__name__ for item in made) or 'nothing'}"
    raise ConfigError(
        f"model.factory: {cfg.factory} returned {what}, not a torch nn.Module or a pair "
        "(module, loss_fn)"
    )


def repeated_block_class(model: nn.Module) -> str | None:
    """The class name of the model's repeated blocks, when it does not say: the first module
    (in `model.modules()` order) holding two or more children of one class defined outside
    torch that have parameters (a `ModuleList` of residual blocks, say). None if none does."""
    for module in model.modules():
        counts = Counter(
            type(child).__name__
            for child in module.children()
            if not type(child).__module__.startswith("torch.")
            and next(child.parameters(), None) is not None
        )
        if counts:
            name, seen = counts.most_common(1)[0]
            if seen >= 2:
                return name
    return None


def check_custom_model(cfg: RaylaneConfig) -> None:
    """Before Ray starts: the factory builds (on the meta device: no memory, no time spent on
    weights) and returns a module or a (module, loss_fn) pair; `model.block_class` names some
    of its modules; a layout that needs blocks or a tensor-parallel plan finds them.
    ConfigError, one line naming the field, otherwise. (No forward runs: torch's meta kernels
    cost seconds to load.)"""
    training = cfg.training.activation_checkpointing
    key = f"{cfg.model.model_dump_json()}|{cfg.parallelism.tp}|{training}"
    if key in _checked:
        return
    model = _build_on_meta(cfg.model)
    name, kind = getattr(model, BLOCK_CLASS_ATTRIBUTE, None), type(model).__name__
    if cfg.model.block_class is not None and not _has_class(model, cfg.model.block_class):
        found = sorted({type(m).__name__ for m in model.modules()} - {kind})
        raise ConfigError(
            f"model.block_class {cfg.model.block_class!r}: {kind} holds no module of that class "
            f"(it holds {', '.join(found) or 'no submodules'})"
        )
    if cfg.training.activation_checkpointing and name is None:
        raise ConfigError(
            f"training.activation_checkpointing recomputes the model's blocks: {kind} has no "
            "repeated children; set model.block_class"
        )
    if cfg.parallelism.dims.tp_enabled:
        _check_tensor_parallel(model, name, cfg.parallelism.tp)
    _checked.add(key)


def _build_on_meta(cfg: ModelConfig) -> nn.Module:
    """The factory's model with its tensors on the meta device; a factory that cannot build
    there (it reads its weights, say) is built on the host instead."""
    try:
        with torch.device("meta"):
            return build_custom(cfg)[0]
    except ConfigError:
        return build_custom(cfg)[0]


def _has_class(model: nn.Module, name: str) -> bool:
    return any(type(m).__name__ == name for m in model.modules() if m is not model)


def _check_tensor_parallel(model: nn.Module, block_class: str | None, tp: int) -> None:
    kind = type(model).__name__
    if getattr(model, "tp_plan", None) is None:
        raise ConfigError(
            f"parallelism.tp {tp} splits the model by its plan, and {kind} has no tp_plan "
            "attribute (the name of a module with block_plan(sequence_parallel), as "
            "raylane.models.gpt_plan); use a data-parallel strategy (ddp, fsdp) or add one"
        )
    if block_class is None:
        raise ConfigError(
            f"parallelism.tp {tp} splits each block by {kind}'s tp_plan, and it has no repeated "
            "children; set model.block_class"
        )
    try:
        plan = importlib.import_module(model.tp_plan)
    except Exception as exc:  # noqa: BLE001 - the user's plan module: say why in one line
        raise ConfigError(
            f"parallelism.tp {tp}: {kind}.tp_plan {model.tp_plan!r} does not import "
            f"({one_line(exc)})"
        ) from None
    if not callable(getattr(plan, "block_plan", None)):
        raise ConfigError(
            f"parallelism.tp {tp}: {kind}.tp_plan {model.tp_plan!r} has no "
            "block_plan(sequence_parallel) function"
        )
