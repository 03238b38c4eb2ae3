"""The run configuration schema: the top level and the data, model, training and tracking
sections (`parallelism:` and `serving:` have modules of their own).

Every field carries a description: it is the documentation (README reference, `--help`, JSON
Schema). Unknown keys are errors, and cross-field checks raise sentences a user understands.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from raylane.config.finetune import FINETUNE_STRATEGIES, FinetuneConfig
from raylane.config.layout import check_layout
from raylane.config.parallelism import ParallelismConfig, StragglerConfig, Strategy
from raylane.config.serving import AutoscalingConfig, GenerationConfig, ServingConfig
from raylane.config.strict import StrictModel

__all__ = [
    "AutoscalingConfig", "DataConfig", "FinetuneConfig", "GenerationConfig", "ModelConfig",
    "ParallelismConfig", "RaylaneConfig", "ServingConfig", "StragglerConfig", "Strategy",
    "StrictModel", "TrackingConfig", "TrainingConfig",
]  # fmt: skip

DIGITS_FEATURES = 64
DIGITS_CLASSES = 10


class DataConfig(StrictModel):
    source: Literal["sklearn-digits", "python-stdlib", "python-stdlib-tests", "parquet"] = Field(
        "sklearn-digits",
        description="Where the data comes from. 'sklearn-digits' (8x8 digit images), "
        "'python-stdlib' (byte windows of the Python standard library's top-level modules, for "
        "language models) and 'python-stdlib-tests' (its test suite, `test/test_*.py`: text "
        "no 'python-stdlib' run has seen, for fine-tuning) are materialised to Parquet by "
        "`raylane prepare` (or on first use); 'parquet' reads existing files you provide.",
    )
    train_path: Path = Field(
        Path("data/digits/train.parquet"),
        description="Parquet file or directory with the training rows (relative to the "
        "working directory).",
    )
    validation_path: Path = Field(
        Path("data/digits/validation.parquet"),
        description="Parquet file or directory with the validation rows.",
    )
    features_column: str = Field(
        "features", description="Column holding each row's features as a list of numbers."
    )
    label_column: str = Field("label", description="Column holding the integer class label.")
    validation_fraction: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="Share of rows held out for validation when preparing a built-in dataset.",
    )
    split_seed: int = Field(
        0, description="Seed of the deterministic train/validation split of a built-in dataset."
    )
    max_bytes: int = Field(
        1 << 19,
        ge=1024,
        description="python-stdlib: how many bytes of source text to take (whole files, in "
        "sorted path order).",
    )
    cache: bool = Field(
        True,
        description="Materialise both splits in Ray's object store once, instead of re-reading "
        "Parquet every epoch. Turn off for datasets larger than the object store.",
    )
    feed: Literal["auto", "memory", "ray_data"] = Field(
        "auto",
        description="How workers read the splits. 'memory': the driver puts each split in "
        "Ray's object store as two arrays and every worker takes its rows of each global batch "
        "(no Ray Data actors to start: seconds less per job). 'ray_data': Ray Data streams "
        "them (sharded across data-parallel workers), for data of any size. 'auto': memory "
        "when cache is on and the two splits together are at most 64 MB on disk.",
    )

    @model_validator(mode="after")
    def _memory_feed_is_cached(self) -> DataConfig:
        if self.feed == "memory" and not self.cache:
            raise ValueError(
                "data.feed 'memory' holds the splits in the object store, which data.cache: "
                "false turns off; set cache: true or feed: ray_data"
            )
        return self


class ModelConfig(StrictModel):
    kind: Literal["mlp", "cnn", "gpt"] = Field(
        "mlp",
        description="Architecture: 'mlp' (fully connected), 'cnn' (convolutions over a square "
        "image; more compute per parameter) or 'gpt' (byte-level decoder-only transformer).",
    )
    input_dim: int = Field(
        DIGITS_FEATURES,
        ge=1,
        description="Number of input features per row (gpt: tokens per sequence).",
    )
    num_classes: int = Field(
        DIGITS_CLASSES, ge=2, description="Number of output classes (gpt: vocabulary size)."
    )
    d_model: int = Field(64, ge=1, description="gpt: width of the residual stream.")
    n_heads: int = Field(4, ge=1, description="gpt: attention heads per block.")
    n_layers: int = Field(4, ge=1, description="gpt: transformer blocks.")
    hidden_sizes: list[int] = Field(
        default_factory=lambda: [128, 128],
        min_length=1,
        description="MLP: width of each hidden layer. CNN: channels of each conv layer.",
    )
    input_scale: float = Field(
        16.0,
        gt=0.0,
        description="Inputs are divided by this inside the model, so clients send raw values "
        "(digits pixels are 0-16).",
    )

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if any(h < 1 for h in self.hidden_sizes):
            raise ValueError("every entry of hidden_sizes must be at least 1")
        if self.kind == "gpt" and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.kind == "cnn" and math.isqrt(self.input_dim) ** 2 != self.input_dim:
            raise ValueError(
                f"kind 'cnn' needs a square image, but input_dim={self.input_dim} is not a "
                "perfect square"
            )
        return self


class TrainingConfig(StrictModel):
    epochs: int = Field(10, ge=1, description="Passes over the training data.")
    batch_size: int = Field(64, ge=1, description="Rows per step on each worker.")
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="Optimizer: 'adamw', or plain 'sgd' (no momentum)."
    )
    lr: float = Field(2e-3, gt=0.0, description="Learning rate of the optimizer.")
    weight_decay: float = Field(0.0, ge=0.0, description="Weight decay of the optimizer.")
    seed: int = Field(0, description="Seed for weights, shuffling and everything random.")
    storage_path: Path = Field(
        Path("runs"), description="Where Ray Train keeps run state and checkpoints."
    )
    steps_per_epoch: int | None = Field(
        None,
        ge=1,
        description="Stop each epoch after this many optimizer steps (None: a full pass). "
        "Short measured epochs for parallelism trials.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block's activations in backward instead of "
        "holding them (gpt): less memory, more compute.",
    )
    precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32",
        description="Compute precision. 'bf16': forwards under bf16 autocast (the loss on fp32 "
        "logits), the parameters, gradients and optimizer state fp32 (master weights); FSDP2 "
        "also gathers parameters in bf16 and reduce-scatters gradients in fp32. It pays off on "
        "GPUs with bf16 and on CPUs with avx512_bf16 or AMX (the run says which) once the "
        "matrices are large; elsewhere bf16 is emulated, slower than fp32. 'tf32' (GPU only: "
        "parallelism.use_gpu): fp32 tensors, with fp32 matrix multiplications on the GPU's "
        "TF32 tensor cores. Recorded with the run and used by the cost models.",
    )
    compile: bool = Field(
        False,
        description="Compile each transformer block with torch.compile (inductor), after "
        "activation checkpointing and before FSDP, as torchtitan does: one graph serves every "
        "block. The first steps pay the compilation (tens of seconds on a GPU). Not with "
        "parallelism.cp > 1 (ring attention's transfers are not traced).",
    )
    resume_from: Path | None = Field(
        None,
        description="A checkpoint directory of an earlier run (runs/<run>/epoch_NNNN, or "
        "epoch_NNNN_step_SSSSSS) to continue from: weights, optimizer state and where in "
        "training it was. Same model and layout.",
    )
    checkpoints_to_keep: int = Field(
        2,
        ge=1,
        description="How many checkpoints to keep (newest first), epoch and step checkpoints "
        "together (Ray Train keeps one list).",
    )
    checkpoint_every_steps: int | None = Field(
        None,
        ge=1,
        description="Also checkpoint every this many optimizer steps inside an epoch "
        "(runs/<run>/epoch_NNNN_step_SSSSSS), so a lost worker group costs at most that many "
        "steps: a restart, or `resume_from` such a directory, continues at the next step of "
        "the same epoch with the same batches, exactly as if nothing had stopped. None: "
        "per-epoch checkpoints only. Not local_sgd, async or ssp (their replicas differ "
        "inside an epoch).",
    )
    max_failures: int = Field(
        0,
        ge=-1,
        description="Worker-group failures to recover from by restarting from the last "
        "checkpoint (-1: unlimited). A node lost without notice is one; drained nodes "
        "(preemptions with a notice) are not counted here.",
    )


class TrackingConfig(StrictModel):
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI. Default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db "
        "in the working directory (what `mlflow ui` opens).",
    )
    registered_model: str = Field(
        "raylane-digits", min_length=1, description="Model Registry name for trained models."
    )
    champion_alias: str = Field(
        "champion", min_length=1, description="Alias that marks the best version; serving loads it."
    )
    champion_metric: str = Field(
        "val_accuracy",
        description="Validation metric (higher is better) that decides whether a new version "
        "takes the champion alias.",
    )
    outage_window_s: float = Field(
        300.0,
        gt=0,
        description="How long training goes on while the tracking server is unreachable; "
        "metrics wait and are sent when it is back. Past it the run stops, resumable.",
    )
    system_metrics_interval_s: float = Field(
        5.0,
        ge=0,
        description="Seconds between samples of CPU, memory, disk, network (and GPU) on every "
        "node that runs workers, logged as the run's system metrics `system/<node>/...`; "
        "0 turns them off.",
    )


class RaylaneConfig(StrictModel):
    experiment: str = Field(
        ..., min_length=1, description="MLflow experiment (and Ray Train run name prefix)."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Dataset.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model architecture.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Optimisation.")
    parallelism: ParallelismConfig = Field(
        default_factory=ParallelismConfig, description="Parallelism strategy and worker group."
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow.")
    serving: ServingConfig = Field(default_factory=ServingConfig, description="Ray Serve endpoint.")
    finetune: FinetuneConfig | None = Field(
        None, description="Start from a registered model and adapt it (`raylane finetune`)."
    )

    @model_validator(mode="after")
    def _check_parallel_layout(self) -> RaylaneConfig:
        check_layout(self)
        return self

    @model_validator(mode="after")
    def _check_step_checkpoints(self) -> RaylaneConfig:
        strategy = self.parallelism.strategy
        if self.training.checkpoint_every_steps is not None and strategy in (
            "async",
            "ssp",
            "local_sgd",
        ):
            raise ValueError(
                f"training.checkpoint_every_steps needs replicas that agree after every step; "
                f"'{strategy}' (replicas apart between averages, or a parameter server's "
                "updates in flight) checkpoints per epoch only"
            )
        return self

    @model_validator(mode="after")
    def _check_finetune(self) -> RaylaneConfig:
        if self.finetune is None:
            return self
        if self.model.kind != "gpt":
            raise ValueError(
                f"finetune adapts a registered gpt language model; model.kind is "
                f"'{self.model.kind}'"
            )
        par = self.parallelism
        if par.strategy not in FINETUNE_STRATEGIES or par.pp > 1 or par.tp > 1:
            raise ValueError(
                f"finetune runs on strategy 'ddp' or 'fsdp' with every worker holding whole "
                f"blocks (got '{par.strategy}', pp {par.pp}, tp {par.tp})"
            )
        return self

    @model_validator(mode="after")
    def _check_dataset_matches_model(self) -> RaylaneConfig:
        if self.data.source in ("python-stdlib", "python-stdlib-tests"):
            if self.model.kind != "gpt":
                raise ValueError(
                    f"data.source '{self.data.source}' is token data: model.kind must be "
                    f"'gpt', not '{self.model.kind}'"
                )
            if self.model.num_classes != 256:
                raise ValueError(
                    f"model.num_classes is {self.model.num_classes} but {self.data.source} "
                    "is byte-level (256 tokens)"
                )
        if self.serving.api == "generate" and self.model.kind != "gpt":
            raise ValueError(
                f"serving.api 'generate' needs a gpt language model, not model.kind "
                f"'{self.model.kind}'"
            )
        if self.data.source == "sklearn-digits" and self.model.kind == "gpt":
            raise ValueError("model.kind 'gpt' needs token data (data.source 'python-stdlib')")
        if self.data.source == "sklearn-digits":
            if self.model.input_dim != DIGITS_FEATURES:
                raise ValueError(
                    f"model.input_dim is {self.model.input_dim} but sklearn-digits rows have "
                    f"{DIGITS_FEATURES} features"
                )
            if self.model.num_classes != DIGITS_CLASSES:
                raise ValueError(
                    f"model.num_classes is {self.model.num_classes} but sklearn-digits has "
                    f"{DIGITS_CLASSES} classes"
                )
        return self
