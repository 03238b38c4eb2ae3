"""`serving:`: the Ray Serve endpoint, its autoscaling and text generation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from raylane.config.model_uri import parse_model_uri
from raylane.config.strict import StrictModel

# A Serve application name (no '#', which Serve's replica ids use as a separator) that is also
# safe in HAProxy backend names, metric labels and actor names.
APP_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"
# A prefix Serve accepts (leading '/', no trailing '/', no '{}' wildcards) made of plain path
# segments, away from Serve's own /-/healthz and /-/routes.
ROUTE_PREFIX_PATTERN = r"^/$|^(?!/-(?:/|$))(?:/(?!\.\.?(?:/|$))[A-Za-z0-9._~-]+)+$"


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
    max_model_len: int = Field(
        8192,  # raylane.serving.generation.engine.MAX_MODEL_LEN (that module runs without pydantic)
        ge=2,
        le=1_048_576,
        description="The longest context a sequence may use (prompt and output), and so the "
        "KV cache's length per slot; the model's own context when that is shorter. A "
        "checkpoint's whole context (128k positions for Llama 3.1) would take gigabytes per "
        "slot. A longer request is refused with its token counts.",
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
        "lookup: `models:/NAME/VERSION` or `models:/NAME@ALIAS` in the same MLflow store: a "
        "smaller model of the same tokens (a gpt over the same bytes, or an imported or "
        "trained Llama with the same tokenizer) and at least the served model's context.",
    )

    max_adapters: int = Field(
        4,
        ge=0,
        le=64,
        description="LoRA adapters of the served model's base a replica holds at once, each "
        "requested as `<model_name>:<NAME>/<VERSION>` (the OpenAI `model` field or the OIP model "
        "name) and loaded from the registry the first time a request names it, without a "
        "restart; sequences of different adapters decode in one batch. The least recently used "
        "idle adapter makes room for the next; 0 serves the model alone.",
    )
    merge_adapter: bool = Field(
        True,
        description="When the served version is a LoRA adapter: fold it into its base's "
        "weights (no per-token adapter cost; only that model is served), or keep it separate "
        "(false) so that other adapters of the same base can be requested beside it.",
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
        "the model's outputs, /v2/models/{model_name}/infer) or 'generate' (a gpt or llama "
        "language model's text: OpenAI-compatible /v1/completions, /v1/chat/completions, "
        "/v1/models, and /v2/models/{model_name}/generate[_stream]).",
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Text generation (api: generate)."
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="Weights of the served model's linear layers: 'none' (in serving.dtype) or "
        "'int8' (torchao weight-only int8, one scale per output channel, quantized on the "
        "replica's device; api: generate).",
    )
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Dtype of the served language model's weights, activations and KV cache: "
        "'fp32', or 'bf16' (half the bytes; on a GPU the fast attention kernels; with int8 "
        "weights, bf16 scales and activations). api: generate.",
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
        "of `ray start` (see docs/guides/production.md).",
    )
    app_name: str = Field(
        "raylane",
        json_schema_extra={"pattern": APP_NAME_PATTERN},
        description="Name of the Serve application: deploy, promote's rollout, status and "
        "stopping act on this application only, so differently named applications (an infer "
        "model and a language model, say) run side by side on one cluster, each at its own "
        "route_prefix.",
    )
    route_prefix: str = Field(
        "/",
        json_schema_extra={"pattern": ROUTE_PREFIX_PATTERN},
        description="Path under which the application answers: '/' (its routes at the "
        "endpoint's root) or e.g. '/lm' (/lm/v1/completions, /lm/docs). Applications on one "
        "cluster share the HTTP port and each needs its own prefix; a request goes to the "
        "application with the longest matching prefix.",
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
    replica_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs each model replica reserves (fractions share one GPU between "
        "replicas, e.g. 0.5). Above 0 the replica computes on its CUDA device; 0 on CPU.",
    )
    cuda_graphs: bool = Field(
        False,
        description="Decode with a fixed-shape step (every KV-cache slot, the whole context "
        "under a mask) captured once in a CUDA graph and replayed: per-token cost is the GPU's, "
        "not Python's. Needs replica_gpus > 0 and generation.speculate 0; steps with a LoRA "
        "adapter in the batch run uncaptured. api: generate.",
    )
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

    @field_validator("app_name")
    @classmethod
    def _serve_app_name(cls, value: str) -> str:
        return _matching(value, APP_NAME_PATTERN, "a Serve application name: 1-63 letters, "
                         "digits, '-' or '_', starting with a letter or digit")  # fmt: skip

    @field_validator("route_prefix")
    @classmethod
    def _serve_route_prefix(cls, value: str) -> str:
        return _matching(value, ROUTE_PREFIX_PATTERN, "a route prefix: '/' or '/name[/name...]' "
                         "(letters, digits, '.', '_', '~', '-'; no trailing '/', '.' or '..'; "
                         "not Serve's own '/-/')")  # fmt: skip

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
        if self.replica_gpus > 1 and not float(self.replica_gpus).is_integer():
            raise ValueError(
                f"replica_gpus {self.replica_gpus:g}: Ray shares a GPU in fractions up to 1 or "
                "gives whole GPUs; use a fraction <= 1 or a whole number"
            )
        if self.cuda_graphs:
            self._check_cuda_graphs()
        if self.dtype != "fp32" and self.api != "generate":
            raise ValueError(
                f"dtype '{self.dtype}' applies to api 'generate' (the infer API serves the "
                "registered torch.export program in the dtype it was exported in)"
            )
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests is 0: use -1 for no limit, or a positive bound")
        return self

    def _check_cuda_graphs(self) -> None:
        if self.api != "generate":
            raise ValueError("cuda_graphs applies to api 'generate' (decoding)")
        if self.replica_gpus <= 0:
            raise ValueError("cuda_graphs needs replica_gpus > 0 (replicas on a GPU)")
        if self.generation.speculate:
            raise ValueError(
                "cuda_graphs captures the plain decode step: it needs generation.speculate 0 "
                f"(not {self.generation.speculate})"
            )


def _matching(value: str, pattern: str, what: str) -> str:
    if not re.fullmatch(pattern, value):
        raise ValueError(f"{value!r} is not {what}")
    return value
