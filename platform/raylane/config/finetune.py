"""The `finetune:` section: start from a registered model and adapt it (LoRA or every weight).

A fine-tuning run is a training run whose model starts from a registered version's weights
(`base`) instead of a fresh initialisation. With `method: lora` the base's weights stay frozen
and low-rank updates (Hu et al. 2021: `W + (alpha / rank) * B @ A`, `B` zero at the start, so
the first step's model is the base) are trained in the `target_modules` linears; what the run
registers is the adapter alone, tagged with the base it belongs to.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raylane.config.model_uri import parse_model_uri
from raylane.config.strict import StrictModel


class FinetuneConfig(StrictModel):
    base: str = Field(
        ...,
        description="The registered model to start from: models:/NAME/VERSION or "
        "models:/NAME@ALIAS. Its recorded architecture must equal `model:`.",
    )
    method: Literal["lora", "full"] = Field(
        "lora",
        description="'lora': train low-rank adapters in `target_modules`, the base frozen; "
        "'full': train every weight, starting from the base's.",
    )
    rank: int = Field(8, ge=1, le=256, description="lora: rank r of each update B @ A.")
    alpha: float = Field(
        16.0, gt=0, description="lora: scaling; the update is (alpha / rank) * B @ A."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="lora: dropout on the adapter's input.")
    target_modules: list[str] = Field(
        ["q", "k", "v", "proj"],
        min_length=1,
        description="lora: names of the linear layers to adapt (matched against the end of "
        "each module's name: 'q', 'k', 'v', 'proj' are the attention projections, 'mlp.0' and "
        "'mlp.2' the MLP's).",
    )

    base_dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="lora: the dtype the frozen base's linear and embedding weights are held "
        "in (the adapters, their gradients and optimizer state are fp32 always). 'bf16': half "
        "the base's bytes, each weight cast to the compute dtype one layer at a time as it is "
        "used (a bf16 checkpoint loses nothing; an fp32 base is rounded); 'fp32': the base as "
        "stored. 'auto': bf16 for a `model.pretrained` checkpoint stored in bf16 under strategy "
        "'ddp' (every worker holds whole blocks), else fp32 (fsdp shards one dtype per block).",
    )

    def frozen_dtype(self, sharded: bool, stored: str | None) -> str | None:
        """The dtype a LoRA run holds its frozen base in, its layout `sharded` (FSDP) or not,
        its checkpoint's weights `stored` in that dtype (config.json's, None when unknown):
        'bf16' or 'fp32'; None for a full fine-tune."""
        if self.method != "lora":
            return None
        if self.base_dtype == "auto":
            return "bf16" if not sharded and stored == "bfloat16" else "fp32"
        return self.base_dtype

    @field_validator("base")
    @classmethod
    def _model_uri(cls, value: str) -> str:
        parse_model_uri(value)  # raises naming the value
        return value.strip()
