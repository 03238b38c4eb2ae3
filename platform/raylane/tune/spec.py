"""The search specification (`configs/tune/*.yaml`): base run, dimensions, constraints."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from raylane.config import ConfigError, load_config
from raylane.config.schema import Strategy, StrictModel


class SearchSpace(StrictModel):
    strategy: list[Strategy] = Field(
        default_factory=lambda: ["ddp", "pipeline", "hybrid"],
        min_length=1,
        description="Strategies to try (the relaxed-consistency ones trade convergence for "
        "throughput: keep constraints.require_falling_loss on).",
    )
    workers: list[int] = Field(
        default_factory=lambda: [1, 2, 4], min_length=1, description="World sizes to try."
    )
    pp: list[int] = Field(
        default_factory=lambda: [2], min_length=1, description="Pipeline stages (pipelined)."
    )
    tp: list[int] = Field(
        default_factory=lambda: [2],
        min_length=1,
        description="Tensor-parallel degrees ('tp'; 'fsdp' also tries tp 1).",
    )
    cp: list[int] = Field(
        default_factory=lambda: [1],
        min_length=1,
        description="Context-parallel degrees: workers each sequence is split over ('ddp' and "
        "'tp'; other strategies run cp 1). model.input_dim must divide into 2 * cp chunks.",
    )
    sequence_parallel: list[bool] = Field(
        default_factory=lambda: [False],
        min_length=1,
        description="Sequence parallelism in tensor-parallel blocks (layouts with tp > 1).",
    )
    microbatches: list[int] = Field(
        default_factory=lambda: [4, 8], min_length=1, description="Micro-batches (pipelined)."
    )
    batch_size: list[int] = Field(
        default_factory=lambda: [32], min_length=1, description="Rows per step per replica."
    )
    grad_compression: list[Literal["none", "fp16", "bf16", "powersgd", "topk"]] = Field(
        default_factory=lambda: ["none"], min_length=1, description="DDP gradient compression."
    )
    activation_checkpointing: list[bool] = Field(
        default_factory=lambda: [False], min_length=1, description="Recompute activations."
    )
    extra: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Any other config fields to search, as dotted key -> values "
        "(e.g. training.lr: [0.001, 0.003]).",
    )


class Constraints(StrictModel):
    cpus: float = Field(2.0, gt=0, description="CPUs a trial's workers may reserve in total.")
    cpus_per_worker: float = Field(0.5, gt=0, description="CPUs each trial worker reserves.")
    memory_mb_per_worker: float = Field(
        4096,
        gt=0,
        description="Largest worker memory (MB) a winner may use: its resident memory on "
        "CPUs, its peak GPU memory (torch.cuda.max_memory_allocated) on GPU trials.",
    )
    activation_mb_per_worker: float | None = Field(
        None,
        gt=0,
        description="Largest predicted activation memory (MB) per worker: layouts predicted "
        "over it are pruned before they run (e.g. what a smaller device leaves for "
        "activations; context parallelism divides them by cp). Unset: no separate limit.",
    )
    require_falling_loss: bool = Field(
        True, description="A winner's training loss must fall over its trial."
    )


class TrialSettings(StrictModel):
    epochs: int = Field(3, ge=2, description="Measured epochs per trial (the first warms up).")
    steps_per_epoch: int = Field(6, ge=1, description="Optimizer steps per trial epoch.")
    warmup_epochs: int = Field(1, ge=0, description="Epochs left out of the throughput.")

    @model_validator(mode="after")
    def _check_warmup(self) -> TrialSettings:
        if self.warmup_epochs >= self.epochs:
            raise ValueError(
                f"warmup_epochs ({self.warmup_epochs}) leaves no measured epoch of {self.epochs}"
            )
        return self


class SchedulerSettings(StrictModel):
    kind: Literal["asha", "none"] = Field(
        "asha", description="'asha' stops clearly slower trials early; 'none' runs all fully."
    )
    grace_period: int = Field(2, ge=1, description="Epochs every trial runs before a cut.")
    reduction_factor: float = Field(2.0, gt=1, description="ASHA keeps 1/rf at each rung.")


class PredictSettings(StrictModel):
    enabled: bool = Field(
        True,
        description="Profile the model on this cluster once (reused from MLflow), predict every "
        "layout's step time and memory, prune what would not fit and measure only the `top_k` "
        "predicted fastest. Off: measure every valid layout.",
    )
    top_k: int = Field(3, ge=1, description="Most layouts measured, best predicted first.")
    margin: float = Field(
        0.2,
        gt=0,
        le=1,
        description="After each measured trial, stop once the next layout's calibrated "
        "prediction is more than this share below the best measured throughput (1: measure "
        "all top_k).",
    )


class TuneSpec(StrictModel):
    experiment: str = Field(..., min_length=1, description="MLflow experiment of the search.")
    base: Path = Field(..., description="Training config every trial starts from.")
    base_overrides: list[str] = Field(
        default_factory=list, description="key.path=value applied to every trial and the winner."
    )
    search: SearchSpace = Field(default_factory=SearchSpace, description="Dimensions.")
    constraints: Constraints = Field(default_factory=Constraints, description="Budgets.")
    trial: TrialSettings = Field(default_factory=TrialSettings, description="Trial length.")
    scheduler: SchedulerSettings = Field(
        default_factory=SchedulerSettings, description="Early stopping."
    )
    predict: PredictSettings = Field(
        default_factory=PredictSettings, description="Which layouts are measured."
    )
    output_dir: Path = Field(
        Path("configs/generated"), description="Where the winner's YAML and the CSV go."
    )
    storage_path: Path = Field(Path("runs/tune"), description="Ray Tune/Train run state.")
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (default as for training)."
    )


def is_search_spec(path: str | Path) -> bool:
    """Whether a YAML file is a search spec (it names a `base` config and a `search`), not a
    training config."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False  # the training config loader says what is wrong with it
    return isinstance(data, dict) and "base" in data and "search" in data


def load_spec(path: str | Path, overrides: list[str] | None = None) -> TuneSpec:
    """Read and validate a search spec; ConfigError names the file and the field."""
    spec = load_config(path, overrides, schema=TuneSpec)
    if not spec.base.is_file():
        raise ConfigError(f"{path}: base: {spec.base} not found")
    return spec
