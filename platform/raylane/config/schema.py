"""The run configuration schema: the top level and the training and tracking sections
(`data:`, `model:`, `parallelism:` and `serving:` have modules of their own).

Every field carries a description: it is the documentation (docs/reference/configuration.md,
`--help`, JSON Schema). Unknown keys are errors, and cross-field checks raise sentences a user
understands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from raylane.config.data import DataConfig, TokenizerTraining
from raylane.config.families import kinds_where, named, traits
from raylane.config.finetune import FinetuneConfig
from raylane.config.layout import check_layout
from raylane.config.model import DIGITS_CLASSES, DIGITS_FEATURES, ModelConfig
from raylane.config.parallelism import ParallelismConfig, StragglerConfig, Strategy
from raylane.config.presets import PRESETS
from raylane.config.serving import AutoscalingConfig, GenerationConfig, ServingConfig
from raylane.config.strict import StrictModel

__all__ = [
    "AutoscalingConfig", "DataConfig", "FinetuneConfig", "GenerationConfig", "ModelConfig",
    "ParallelismConfig", "RaylaneConfig", "ServingConfig", "StragglerConfig", "Strategy",
    "StrictModel", "TrackingConfig", "TrainingConfig",
]  # fmt: skip


#: Failures an elastic run recovers from when `training.max_failures` is not set.
ELASTIC_MAX_FAILURES = 3
#: The model kinds that read token data, generate text and take adapters.
LANGUAGE_MODELS = kinds_where("language")
#: The training fields a LoRA fine-tune sets unless the config does: most of what a step of a
#: frozen base holds is its activations (recomputed: the same gradients) and the pages the C
#: allocator keeps after they are freed.
LORA_DEFAULTS = {"activation_checkpointing": True, "host_memory": "lean"}


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
        "holding them (gpt, llama, a custom model's blocks): less memory, more compute, the "
        "same gradients. A LoRA fine-tune turns it on unless the config sets it.",
    )
    host_memory: Literal["fast", "lean"] = Field(
        "fast",
        description="How a worker's C allocator treats host memory (CPU tensors; a GPU's are "
        "the device's): 'lean' gives every block of 1 MB or more back to the system when it is "
        "freed, so the process holds what its tensors hold, at the price of fresh pages for "
        "large blocks: a 0.5B LoRA step on a 2-core CPU held 2.8 GB with it and 5.0 without, "
        "and took 19 s with it and 14 without. A LoRA fine-tune turns it on unless the config "
        "sets it.",
    )
    progress_every_s: float = Field(
        10.0,
        ge=0,
        description="Inside an epoch, one console line every this many seconds: the step, "
        "samples per second, the share of time waiting for data and what is left of the "
        "epoch. 0: a line per finished epoch only.",
    )
    loss_chunk_mb: float = Field(
        64.0,
        ge=0,
        description="A language model's head and loss run together in chunks of tokens whose "
        "fp32 logits hold at most this many MB, recomputed in backward: no step holds the whole "
        "vocabulary's logits (a 151,936-token vocabulary at 4 x 256 tokens: 622 MB each copy). "
        "Equal to the unchunked loss; where a step's logits fit in one chunk, it is the plain "
        "loss. 0: the whole logits (gpt and llama with data or FSDP parallelism; other layouts "
        "always hold them).",
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
    max_failures: int | None = Field(
        None,
        ge=-1,
        description="Worker-group failures to recover from by restarting from the last "
        "checkpoint (-1: unlimited). A node lost without notice is one; drained nodes "
        "(preemptions with a notice) are not counted here. Unset: "
        f"{ELASTIC_MAX_FAILURES} for an elastic worker range (spot capacity, where nodes go "
        "without notice too), 0 otherwise.",
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
        description="Validation metric that decides whether a new version takes the champion "
        "alias (a language model's `val_loss`, a classifier's `val_accuracy`).",
    )
    champion_goal: Literal["auto", "max", "min"] = Field(
        "auto",
        description="Whether the champion metric is better higher ('max') or lower ('min'); "
        "'auto': lower for a loss, bits per byte or perplexity, higher otherwise.",
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

    @property
    def champion_higher_is_better(self) -> bool:
        """Whether a higher `champion_metric` is a better model."""
        if self.champion_goal != "auto":
            return self.champion_goal == "max"
        return not self.champion_metric.endswith(("loss", "bits_per_byte", "perplexity"))


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

    @property
    def failures_tolerated(self) -> int:
        """`training.max_failures`, or its default for this layout (elastic or not)."""
        if self.training.max_failures is not None:
            return self.training.max_failures
        return ELASTIC_MAX_FAILURES if self.parallelism.elastic else 0

    @model_validator(mode="after")
    def _check_parallel_layout(self) -> RaylaneConfig:
        check_layout(self)
        return self

    @model_validator(mode="after")
    def _check_llama_support(self) -> RaylaneConfig:
        """A llama trains where its workers agree in lockstep (all-reduce or sharding): whole
        blocks per worker, split by its tensor-parallel plan (`raylane.models.llama_plan`), cut
        into pipeline stages, each sequence split over context-parallel workers, or its
        tensor-parallel plan inside stages or context-parallel groups (not yet with sequence
        parallelism there, nor with sharded stages: not proven)."""
        kind = self.model.kind
        if not traits(kind).lockstep_only:
            return self
        par, dims = self.parallelism, self.parallelism.dims
        if dims.sync.kind != "all_reduce":
            raise ValueError(
                f"model.kind '{kind}' trains with strategy 'ddp', 'fsdp', 'tp', 'pipeline' or "
                f"'hybrid' (got '{par.strategy}')"
            )
        split = dims.tp_enabled and (dims.pp_enabled or dims.cp_enabled)
        if split and (par.sequence_parallel or dims.dp_shard > 1):
            raise ValueError(
                f"model.kind '{kind}' takes tp {par.tp} inside pipeline stages or context-"
                "parallel groups without sequence_parallel and without sharded stages (fsdp): "
                "not proven yet"
            )
        if dims.tp_enabled:
            _check_llama_split(self.model, par.tp, par.sequence_parallel)
        return self

    @model_validator(mode="after")
    def _check_step_checkpoints(self) -> RaylaneConfig:
        sync = self.parallelism.dims.sync
        if self.training.checkpoint_every_steps is not None and sync.kind != "all_reduce":
            raise ValueError(
                f"training.checkpoint_every_steps needs replicas that agree after every step; "
                f"'{self.parallelism.strategy}' ({sync.describe()}: replicas apart between "
                "averages, or updates in flight) checkpoints per epoch only"
            )
        return self

    @model_validator(mode="after")
    def _check_finetune(self) -> RaylaneConfig:
        if self.finetune is None:
            return self
        finetune = "finetune adapts a registered language model"
        _require_kind(self.model.kind, LANGUAGE_MODELS, finetune)
        par, dims = self.parallelism, self.parallelism.dims
        # Every worker trains the whole (adapted) model, replicated or sharded, in lockstep.
        if dims.sync.kind != "all_reduce" or dims.pp_enabled or dims.tp_enabled:
            raise ValueError(
                f"finetune runs on strategy 'ddp' or 'fsdp' with every worker holding whole "
                f"blocks (got '{par.strategy}', pp {par.pp}, tp {par.tp})"
            )
        _check_base_dtype(self.finetune, PRESETS[par.strategy].shard)
        if self.finetune.method == "lora":
            for name, value in LORA_DEFAULTS.items():
                if name not in self.training.model_fields_set:
                    setattr(self.training, name, value)
        return self

    def frozen_base_dtype(self) -> str | None:
        """The dtype a LoRA run holds its frozen base in ('bf16' or 'fp32',
        `FinetuneConfig.frozen_dtype`); None without a LoRA fine-tune."""
        if self.finetune is None:
            return None
        sharded = PRESETS[self.parallelism.strategy].shard
        return self.finetune.frozen_dtype(sharded, self.model.stored_dtype())

    @model_validator(mode="after")
    def _check_tokenizer_fits_model(self) -> RaylaneConfig:
        """Token data needs a language model with a class for every token; a given
        tokenizer.json's vocabulary is checked when the files are prepared. Tables (csv,
        parquet) need a classifier."""
        if self.data.source != "files":
            return self
        if self.data.tabular:
            tables = "data.files are tables (csv, parquet) of features and a class"
            _require_kind(self.model.kind, kinds_where("tabular"), tables)
            return self
        _require_kind(self.model.kind, LANGUAGE_MODELS, "data.source 'files' is token data")
        tokenizer = self.data.tokenizer
        if tokenizer == "bytes":
            vocabulary, what = 256, "'bytes' has 256 tokens"
        elif isinstance(tokenizer, TokenizerTraining):
            vocabulary = tokenizer.train.vocab_size
            what = f"trains a BPE of up to {vocabulary} tokens"
        else:
            return self
        if self.model.num_classes < vocabulary:
            raise ValueError(
                f"model.num_classes is {self.model.num_classes} but data.tokenizer {what}; set "
                f"model.num_classes to at least {vocabulary}"
            )
        return self

    @model_validator(mode="after")
    def _check_dataset_matches_model(self) -> RaylaneConfig:
        if self.data.source in ("python-stdlib", "python-stdlib-tests"):
            token_data = f"data.source '{self.data.source}' is token data"
            _require_kind(self.model.kind, LANGUAGE_MODELS, token_data)
            if self.model.num_classes != 256:
                raise ValueError(
                    f"model.num_classes is {self.model.num_classes} but {self.data.source} "
                    "is byte-level (256 tokens)"
                )
        if self.serving.api == "generate":
            serves = "serving.api 'generate' serves a language model"
            _require_kind(self.model.kind, LANGUAGE_MODELS, serves)
        if self.data.source == "sklearn-digits" and traits(self.model.kind).language:
            raise ValueError(
                f"model.kind '{self.model.kind}' needs token data, not data.source "
                "'sklearn-digits' (e.g. 'python-stdlib')"
            )
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


def _check_base_dtype(finetune: FinetuneConfig, sharded: bool) -> None:
    """`finetune.base_dtype`: a LoRA base's; bf16 only where blocks are not sharded."""
    if finetune.base_dtype == "auto":
        return
    if finetune.method != "lora":
        raise ValueError(
            "finetune.base_dtype holds a LoRA run's frozen base; method 'full' trains every "
            "weight in the training precision (remove base_dtype)"
        )
    if finetune.base_dtype == "bf16" and sharded:
        raise ValueError(
            "finetune.base_dtype 'bf16' with a sharded layout (fsdp): FSDP shards one dtype per "
            "block, and the adapters are fp32; use 'fp32' or 'auto', or strategy 'ddp'"
        )


def _require_kind(kind: str, allowed: tuple[str, ...], what: str) -> None:
    """One line, `what` first, when `kind` is not one of `allowed`."""
    if kind not in allowed:
        raise ValueError(f"{what}: model.kind must be {named(allowed)}, not '{kind}'")


def _check_llama_split(model: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Each of `tp` workers holds whole query heads, whole key/value heads and an equal part of
    the MLP; a vocabulary-split head cannot stay tied to the (whole) embedding."""
    for field, width in model.llama_widths().items():
        if width % tp:
            raise ValueError(
                f"model.{field} ({width}) is not divisible by parallelism.tp ({tp}): each "
                "tensor-parallel worker holds an equal part of every block"
            )
    if sequence_parallel and model.llama_tied():
        raise ValueError(
            "parallelism.sequence_parallel splits the head over the vocabulary, which a llama "
            "with tied embeddings (model.tie_embeddings) shares with its whole embedding"
        )
