"""Model-state memory per device for a layout, predicted from parameter counts.

Model state is parameters, gradients and optimizer state (activations are separate). With
mixed-precision Adam, as in ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020, section 3.1), each parameter costs 2 bytes of
fp16 weight, 2 of fp16 gradient and K = 12 of optimizer state (fp32 master weight, momentum,
variance). ZeRO stage 1 shards the optimizer state over the Nd data-parallel devices, stage 2
also the gradients, stage 3 (FSDP) also the parameters. Tensor parallelism divides a block's
split weights by tp and keeps the rest (embeddings, norms, the row-wise layers' biases) whole;
pipeline parallelism gives each device one stage's blocks (the parameter counts are the
family's shape: `raylane.models.shape.DecoderShape`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of model state."""

    param: float
    grad: float
    optimizer: float


#: fp16 weights and gradients, fp32 Adam (ZeRO's K = 12).
MIXED_PRECISION_ADAM = StateBytes(param=2, grad=2, optimizer=12)
#: fp32 weights, gradients and Adam's two moments: what raylane's CPU runs train with.
FP32_ADAM = StateBytes(param=4, grad=4, optimizer=8)


@dataclass(frozen=True)
class ModelState:
    param: float
    grad: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


def sharded_state(
    params: float, dp: int, zero_stage: int, per_param: StateBytes = MIXED_PRECISION_ADAM
) -> ModelState:
    """Model state on one of `dp` data-parallel devices holding `params` parameters each
    before sharding, under ZeRO stage `zero_stage` (0: plain data parallel; 3: FSDP)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be at least 1, not {dp}")
    return ModelState(
        param=per_param.param * params / (dp if zero_stage >= 3 else 1),
        grad=per_param.grad * params / (dp if zero_stage >= 2 else 1),
        optimizer=per_param.optimizer * params / (dp if zero_stage >= 1 else 1),
    )
