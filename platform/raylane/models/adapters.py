"""LoRA adapters on a plain model, with Hugging Face PEFT (`raylane.config.finetune`).

`apply_lora` injects PEFT's LoRA layers into the named linears of the model in place (no
wrapper class: the model stays a `GPT`, its forward and KV-cache decoding unchanged) and leaves
only the adapters trainable. Each adapted linear keeps the base weight as `<name>.base_layer`
and adds `<name>.lora_A.default` / `<name>.lora_B.default`; `B` starts at zero, so until the
first update the model computes exactly what the base does. `adapter_state` is what a run
registers (the adapter alone), `load_adapter` puts it back on a freshly adapted base, and
`merge_adapters` folds the updates into the base weights (no adapter cost per token).
PEFT is imported by these functions only: a run that fine-tunes nothing never pays its imports.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from raylane.models.frozen import hold_frozen

if TYPE_CHECKING:
    from raylane.config.finetune import FinetuneConfig


class AdapterTargetError(ValueError):
    """`finetune.target_modules` names no layer of the model."""


def apply_lora(model: nn.Module, finetune: FinetuneConfig) -> nn.Module:
    """Inject LoRA into `finetune.target_modules` of `model` (in place) and freeze the rest."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=finetune.rank,
        lora_alpha=finetune.alpha,
        lora_dropout=finetune.dropout,
        target_modules=list(finetune.target_modules),
    )
    paths = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    missing = [
        t for t in finetune.target_modules if not any(p == t or p.endswith("." + t) for p in paths)
    ]
    if missing:
        names = sorted({re.sub(r"^blocks\.\d+\.", "", p) for p in paths})
        raise AdapterTargetError(
            f"finetune.target_modules {missing} match no linear layer of the model; its "
            f"linears are {', '.join(names)}"
        )
    inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)
    return model


def adapt(model: nn.Module, finetune: FinetuneConfig, frozen: str | None) -> nn.Module:
    """A fine-tune's model from its base (in place): the base held in bf16 when `frozen` says
    so (`raylane.models.frozen`; first, so that PEFT makes the adapters fp32), then LoRA's
    adapters for method 'lora'."""
    if frozen == "bf16":
        model.requires_grad_(False)
        hold_frozen(model, torch.bfloat16, torch.float32)
    if finetune.method == "lora":
        apply_lora(model, finetune)
    return model


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights alone, under the model's own parameter names."""
    return {
        name: tensor.detach().cpu().clone()
        for name, tensor in model.state_dict().items()
        if ".lora_" in name
    }


def load_adapter(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """Load `adapter_state` output into a model `apply_lora` adapted the same way."""
    expected = {name for name in model.state_dict() if ".lora_" in name}
    if expected != set(state):
        extra, absent = sorted(set(state) - expected), sorted(expected - set(state))
        raise ValueError(
            f"the adapter does not fit this model: {len(extra)} tensors it has no place for "
            f"{extra[:2]}, {len(absent)} it lacks {absent[:2]}"
        )
    model.load_state_dict(state, strict=False)
    return model


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its base weight and drop the adapter layers (in place):
    a plain model again, with the plain model's parameter names."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    return model


def trainable_fraction(model: nn.Module) -> float:
    """Trainable parameters over all parameters."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad) / max(total, 1)
