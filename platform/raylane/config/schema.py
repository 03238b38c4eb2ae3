"""The run configuration schema.

Every field carries a description: it is the documentation (README reference, `--help`, JSON
Schema). Unknown keys are errors, and cross-field checks raise sentences a user understands.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raylane.config.model_uri import parse_model_uri

DIGITS_FEATURES = 64
DIGITS_CLASSES = 10


class StrictModel(BaseModel):
    """Base for every section: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(StrictModel):
    source: Literal["sklearn-digits", "python-stdlib", "parquet"] = Field(
        "sklearn-digits",
        description="Where the data comes from. 'sklearn-digits' (8x8 digit images) and "
        "'python-stdlib' (byte windows of the Python standard library's source, for language "
        "models) are materialised to Parquet by `raylane prepare` (or on first use); 'parquet' "
        "reads existing files you provide.",
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
    resume_from: Path | None = Field(
        None,
        description="A checkpoint directory of an earlier run (runs/<run>/epoch_NNNN) to "
        "continue from: weights, optimizer state and epoch count. Same model and layout.",
    )
    checkpoints_to_keep: int = Field(
        2, ge=1, description="How many per-epoch checkpoints to keep (newest first)."
    )
    max_failures: int = Field(
        0,
        ge=-1,
        description="Worker-group failures to recover from by restarting from the last "
        "checkpoint (-1: unlimited).",
    )


class StragglerConfig(StrictModel):
    rank: int | list[int] = Field(
        ...,
        description="The worker (world rank) that straggles, or several that take turns "
        "(staggered within each `every` steps).",
    )
    every: int = Field(1, ge=1, description="It sleeps before every `every`-th step.")
    delay_s: float = Field(..., gt=0, le=60, description="How long it sleeps each time.")
    first_epoch: int = Field(0, ge=0, description="First epoch it straggles in.")
    last_epoch: int | None = Field(
        None, ge=0, description="Last epoch it straggles in (unset: to the end)."
    )

    @field_validator("rank")
    @classmethod
    def _check_ranks(cls, rank: int | list[int]) -> int | list[int]:
        ranks = rank if isinstance(rank, list) else [rank]
        if not ranks or min(ranks) < 0 or len(set(ranks)) != len(ranks):
            raise ValueError("must be a worker rank >= 0, or a list of distinct ones")
        return rank

    @property
    def ranks(self) -> list[int]:
        return self.rank if isinstance(self.rank, list) else [self.rank]


Strategy = Literal["ddp", "pipeline", "hybrid", "tp", "fsdp", "local_sgd", "async", "ssp"]


class ParallelismConfig(StrictModel):
    strategy: Strategy = Field(
        "ddp",
        description="How the model is parallelised. 'ddp': data parallel "
        "(DistributedDataParallel, synchronous all-reduce); 'pipeline': the model's blocks "
        "split into `pp` stages on different workers, micro-batched; 'hybrid': `dp` "
        "data-parallel replicas of a `pp`-stage pipeline; 'tp': each block's attention heads "
        "and MLP split over `tp` workers (tensor parallel), `dp` replicas of that; 'fsdp': "
        "parameters, gradients and optimizer state sharded over the `dp` workers (FSDP2), each "
        "block also tensor parallel when `tp` > 1. Relaxed consistency, data parallel: "
        "'local_sgd' (parameters averaged every `local_sgd_period` steps), 'async' (a parameter "
        "server on Ray actors, no waiting), 'ssp' (the same, at most `staleness` steps ahead).",
    )
    workers: int = Field(
        2,
        ge=1,
        description="Ray Train workers (processes) in the job: dp * pp (pipeline, hybrid), "
        "dp * tp (tp, fsdp).",
    )
    pp: int = Field(1, ge=1, description="Pipeline stages (pipeline/hybrid).")
    dp: int = Field(
        1,
        ge=1,
        description="Data-parallel degree: replicas of the pipeline (hybrid) or of the "
        "tensor-parallel model (tp), shards of the model (fsdp). For tp and fsdp, 1 means "
        "workers / tp.",
    )
    tp: int = Field(
        1, ge=1, description="Tensor-parallel degree: workers each block is split over (tp, fsdp)."
    )
    microbatches: int = Field(
        1, ge=1, description="Micro-batches each batch is cut into for the pipeline schedule."
    )
    schedule: Literal["gpipe", "1f1b"] = Field(
        "gpipe",
        description="Pipeline schedule: 'gpipe' (all forwards, then all backwards) or '1f1b' "
        "(one forward one backward; fewer activations held).",
    )
    split_points: list[int] | None = Field(
        None,
        description="Block indices where stages 2..pp begin (pp - 1 of them, increasing). "
        "Default: an even split of the model's blocks.",
    )
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 0.5},
        description="Ray resources each worker reserves. Keep CPU below 1 on small machines so "
        "Ray Data's read tasks can still be scheduled next to the workers.",
    )
    use_gpu: bool = Field(False, description="One GPU per worker; NCCL instead of gloo.")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per worker. Default: the machine's cores divided "
        "by the workers, at least 1, so workers do not oversubscribe cores.",
    )
    grad_compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = Field(
        "none",
        description="DDP gradient compression through a communication hook: 'fp16'/'bf16' "
        "halve the all-reduced bytes ('bf16' on NCCL only), 'powersgd' sends a rank-1 "
        "approximation, 'topk' the largest `topk_ratio` of the entries (values + indices); "
        "both with error feedback (ddp only). Every hook counts the bytes it sends.",
    )
    topk_ratio: float = Field(
        0.01, gt=0, le=0.5, description="Share of gradient entries 'topk' compression sends."
    )
    local_sgd_period: int = Field(
        4, ge=1, description="'local_sgd': steps between parameter averages (H)."
    )
    staleness: int = Field(
        2, ge=0, description="'ssp': most steps a worker may run ahead of the slowest."
    )
    staleness_lr: bool = Field(
        False,
        description="'async'/'ssp': divide an update's learning rate by its staleness.",
    )
    ps_shards: int = Field(
        2, ge=1, description="'async'/'ssp': parameter-server actors the model is split over."
    )
    straggler: StragglerConfig | None = Field(
        None,
        description="Make workers slow on purpose: {rank (one or a list taking turns), "
        "every, delay_s, first_epoch, last_epoch}; see README, Communication and consistency.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy of the worker group."
    )

    @model_validator(mode="after")
    def _check_resources(self) -> ParallelismConfig:
        for name, amount in self.resources_per_worker.items():
            if amount < 0:
                raise ValueError(f"resources_per_worker.{name} must not be negative")
        if self.use_gpu and self.resources_per_worker.get("GPU", 1) == 0:
            raise ValueError("use_gpu is true but resources_per_worker.GPU is 0")
        return self


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


class AutoscalingConfig(StrictModel):
    min_replicas: int = Field(1, ge=0, description="Fewest model replicas.")
    max_replicas: int = Field(2, ge=1, description="Most model replicas.")
    target_ongoing_requests: float | None = Field(
        None,
        gt=0,
        description="Requests in flight per replica that autoscaling aims for. Default: "
        "serving.max_batch_size: a batching replica needs a full batch in flight, and a lower "
        "target splits the load into half-full batches (benchmarks/README.md, serve_load).",
    )
    upscale_delay_s: float = Field(5.0, ge=0, description="Seconds of high load before adding.")
    downscale_delay_s: float = Field(30.0, ge=0, description="Seconds of low load before removing.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is larger than max_replicas "
                f"({self.max_replicas})"
            )
        return self


class GenerationConfig(StrictModel):
    max_num_seqs: int = Field(
        8,
        ge=1,
        description="Sequences a replica decodes together (its KV-cache slots); more requests "
        "wait for a slot, up to max_ongoing_requests + max_queued_requests in all.",
    )
    default_max_tokens: int = Field(
        16, ge=1, description="Tokens (bytes) generated when a request does not say."
    )
    speculate: int = Field(
        0,
        ge=0,
        le=16,
        description="Speculative decoding: tokens each sequence proposes per step, checked in "
        "one forward (0: off); by prompt lookup (from its own earlier text) unless "
        "`draft_model` names a draft. Greedy output is unchanged; sampled output keeps its "
        "distribution.",
    )
    draft_model: str | None = Field(
        None,
        description="A registered draft that proposes the `speculate` tokens instead of prompt "
        "lookup: `models:/NAME/VERSION` or `models:/NAME@ALIAS`, a smaller gpt over the same "
        "bytes with at least the served model's context, in the same MLflow store.",
    )

    @field_validator("draft_model")
    @classmethod
    def _model_uri(cls, value: str | None) -> str | None:
        if value is not None:
            parse_model_uri(value)  # ValueError naming the form
        return value

    @model_validator(mode="after")
    def _draft_proposes(self) -> GenerationConfig:
        if self.draft_model is not None and self.speculate < 1:
            raise ValueError(
                "draft_model needs speculate >= 1 (the tokens the draft proposes per step)"
            )
        return self


class ServingConfig(StrictModel):
    api: Literal["infer", "generate"] = Field(
        "infer",
        description="What the endpoint answers: 'infer' (Open Inference Protocol v2 infer on "
        "the model's outputs, /v2/models/{model_name}/infer) or 'generate' (a gpt language "
        "model's text: OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models, "
        "and /v2/models/{model_name}/generate[_stream]).",
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Text generation (api: generate)."
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="Weights of the served model's linear layers: 'none' (fp32) or 'int8' "
        "(torchao weight-only int8, one scale per output channel; api: generate).",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address the HTTP proxy binds. Anything else is an explicit choice.",
    )
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the endpoint.")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy",
        description="HTTP ingress of a Ray that raylane starts: 'haproxy' (Serve's HAProxy in "
        "front of replicas listening on their own ports, 127.0.0.1:30000-31000 by default) or "
        "'proxy' (Serve's Python proxy). A `ray start` cluster takes it from the environment "
        "of `ray start` (see README, Serving).",
    )
    model_name: str = Field(
        "digits",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Name in the endpoint's URLs: /v2/models/{model_name}/infer.",
    )
    max_batch_size: int = Field(32, ge=1, description="Most requests merged into one forward.")
    batch_wait_timeout_s: float = Field(
        0.01, ge=0, description="How long a batch waits to fill before it runs anyway."
    )
    replica_cpus: float = Field(0.5, gt=0, description="CPUs each model replica reserves.")
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each model replica reserves, to place replicas on a "
        "node type (e.g. {serving: 1} with nodes started with --resources='{\"serving\": 4}').",
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests a replica accepts at once (should exceed max_batch_size)."
    )
    max_queued_requests: int = Field(
        128,
        ge=-1,
        description="Requests the proxy holds for the model beyond what replicas accept; past "
        "it a request gets 503 with Retry-After at once. -1 queues without limit.",
    )
    retry_after_s: float = Field(
        1.0, ge=0, description="Retry-After (seconds) sent with a 503 for a full queue."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above it)."
    )
    api_key_env: str = Field(
        "RAYLANE_API_KEY",
        min_length=1,
        description="Environment variable holding the API key. When it (or api_key_file) gives "
        "a key, inference routes need `Authorization: Bearer <key>`; health routes stay open.",
    )
    api_key_file: Path | None = Field(
        None, description="File holding the API key (a mounted secret); wins over api_key_env."
    )
    model_version: int | None = Field(
        None,
        ge=1,
        description="Registry version to serve. Unset: the version holding the champion alias "
        "when deploying. Deploying another version rolls the running app onto it.",
    )
    surge_percent: int = Field(
        100,
        ge=0,
        le=100,
        description="Extra replicas started during an upgrade (percent of the current count): "
        "old replicas serve until the new ones are ready. 0 stops old ones first.",
    )
    log_encoding: Literal["JSON", "TEXT"] = Field(
        "JSON", description="Replica log format; JSON access logs carry request ids."
    )
    access_log: bool = Field(
        True,
        description="Write one access-log line per request in the replica logs (turning it off "
        "changed throughput by less than the noise in benchmarks/serve_load.py).",
    )
    autoscaling: AutoscalingConfig = Field(
        default_factory=AutoscalingConfig, description="Replica autoscaling."
    )

    @model_validator(mode="after")
    def _check_batching(self) -> ServingConfig:
        if self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) is smaller than "
                f"max_batch_size ({self.max_batch_size}): batches could never fill"
            )
        if self.quantization != "none" and self.api != "generate":
            raise ValueError(
                f"quantization '{self.quantization}' applies to api 'generate' (the infer API "
                "serves the registered torch.export program as it is)"
            )
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests is 0: use -1 for no limit, or a positive bound")
        return self


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

    @model_validator(mode="after")
    def _check_parallel_layout(self) -> RaylaneConfig:
        from raylane.config.layout import check_layout

        check_layout(self)
        return self

    @model_validator(mode="after")
    def _check_dataset_matches_model(self) -> RaylaneConfig:
        if self.data.source == "python-stdlib":
            if self.model.kind != "gpt":
                raise ValueError(
                    f"data.source 'python-stdlib' is token data: model.kind must be 'gpt', "
                    f"not '{self.model.kind}'"
                )
            if self.model.num_classes != 256:
                raise ValueError(
                    f"model.num_classes is {self.model.num_classes} but python-stdlib is "
                    "byte-level (256 tokens)"
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
