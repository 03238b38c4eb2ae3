"""`parallelism:`: the strategy, its degrees and the worker group (cross-field layout rules
are `raylane.config.layout`'s)."""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from raylane.config.dims import ParallelDims, Sync
from raylane.config.presets import SyncKind
from raylane.config.strict import StrictModel


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


Compression = Literal["none", "fp16", "bf16", "powersgd", "topk"]
#: Defaults shared by the named fields and a layout's `sync:` section.
LOCAL_SGD_PERIOD, STALENESS, PS_SHARDS = 4, 2, 2


class SyncConfig(StrictModel):
    """How the data-parallel workers agree, for a layout given by its degrees."""

    kind: SyncKind = Field(
        "all_reduce",
        description="'all_reduce': every step's gradients (FSDP: reduce-scattered); "
        "'periodic_average': parameters averaged every `period` steps (local SGD); "
        "'parameter_server': updates pushed to parameter-server actors (`staleness` bounds how "
        "far a worker runs ahead; unset: unbounded).",
    )
    compression: Compression = Field(
        "none", description="all_reduce: the gradient compression (see `grad_compression`)."
    )
    period: int = Field(
        LOCAL_SGD_PERIOD, ge=1, description="periodic_average: steps between averages."
    )
    staleness: int | None = Field(
        None, ge=0, description="parameter_server: most steps ahead of the slowest worker."
    )
    shards: int = Field(
        PS_SHARDS, ge=1, description="parameter_server: actors the model is split over."
    )

    def as_fields(self) -> dict:
        """The `parallelism:` fields this sync sets."""
        return {
            "grad_compression": self.compression,
            "local_sgd_period": self.period,
            "staleness": STALENESS if self.staleness is None else self.staleness,
            "ps_shards": self.shards,
        }


#: Keys that give a layout by its degrees rather than by a strategy name.
DEGREE_KEYS = ("dp_shard", "sync")


class ParallelismConfig(StrictModel):
    strategy: Strategy = Field(
        "ddp",
        description="A named layout (or give the degrees: `dp_shard`, `pp`, `tp`, `cp` and "
        "`sync`, and the name is the one they make). 'ddp': data parallel "
        "(DistributedDataParallel, synchronous all-reduce); 'pipeline': the model's blocks "
        "split into `pp` stages on different workers, micro-batched; 'hybrid': `dp` "
        "data-parallel replicas of a `pp`-stage pipeline; 'tp': each block's attention heads "
        "and MLP split over `tp` workers (tensor parallel), `dp` replicas of that; 'fsdp': "
        "parameters, gradients and optimizer state sharded over the `dp` workers (FSDP2), each "
        "block also tensor parallel when `tp` > 1, and with `pp` > 1 each pipeline stage sharded "
        "over its `dp` workers (pp x fsdp). Relaxed consistency, data parallel: "
        "'local_sgd' (parameters averaged every `local_sgd_period` steps), 'async' (a parameter "
        "server on Ray actors, no waiting), 'ssp' (the same, at most `staleness` steps ahead).",
    )
    workers: int = Field(
        2,
        ge=1,
        description="Ray Train workers (processes) in the job: dp * pp * tp (pipeline, hybrid, "
        "fsdp with pp > 1), dp * tp (tp, fsdp). `{min: M, max: N}` makes a ddp or fsdp run "
        "(pp, tp, cp 1) elastic: "
        "it starts with N workers when the cluster has room for them, with M at least, and "
        "resizes when nodes leave or join; stored as `workers: N, min_workers: M`.",
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        description="An elastic run's fewest workers (`workers` is then the most). The global "
        "batch stays `training.batch_size * workers` at every size (each worker's share is "
        "recomputed) and every worker reads the same global batches, so the samples per step "
        "do not depend on the size. Each resize restarts the worker group from the latest "
        "checkpoint: set `training.checkpoint_every_steps`.",
    )
    elastic_resize_monitor_s: float = Field(
        60.0,
        gt=0,
        description="Elastic runs: seconds between Ray Train's checks for room to grow.",
    )
    pp: int = Field(1, ge=1, description="Pipeline stages (pipeline, hybrid, fsdp).")
    dp: int = Field(
        1,
        ge=1,
        description="Data-parallel degree: replicas of the pipeline (hybrid) or of the "
        "tensor-parallel model (tp), shards of the model or of each stage (fsdp; with "
        "`dp_shard` below it, HSDP: replicas x shards). For tp and fsdp without stages, 1 "
        "means workers / tp.",
    )
    tp: int = Field(
        1, ge=1, description="Tensor-parallel degree: workers each block is split over (tp, fsdp)."
    )
    cp: int = Field(
        1,
        ge=1,
        description="Context-parallel degree: workers each sequence is split over (ddp, tp). "
        "Each holds 2 of 2*cp equal chunks (the first and last, then the next pair: equal "
        "causal work) with their own positions and loss; attention is exact, by ring attention "
        "(key/value blocks passed around the cp workers). workers = dp * cp (* tp).",
    )
    dp_shard: int | None = Field(
        None,
        ge=1,
        description="A layout by its degrees: data-parallel workers that shard parameters, "
        "gradients and optimizer state (FSDP2; with `pp` each stage's). Given with `sync` "
        "or instead of `strategy`, the strategy is the one the degrees make. Below "
        "workers / (pp * tp * cp), the rest are replicas of the sharded model (HSDP; "
        "pp = tp = cp = 1).",
    )
    sync: SyncConfig | None = Field(
        None,
        description="A layout by its degrees: how the data-parallel workers agree "
        "({kind, compression, period, staleness, shards}); sets grad_compression, "
        "local_sgd_period, staleness and ps_shards.",
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
    sequence_parallel: bool = Field(
        False,
        description="With tp > 1: each tensor-parallel block's norms and residual adds "
        "work on 1/tp of the sequence (Megatron-style sequence parallelism): its all-reduces "
        "become reduce-scatter + all-gather (the same bytes), its column-wise matmuls keep "
        "only their input's shard for backward (gathering it again there), and outside a "
        "pipeline the head is split over the vocabulary (torch's loss_parallel), so what "
        "blocks and head keep for backward shrinks by about tp (tp, fsdp x tp, 3D).",
    )
    grad_compression: Compression = Field(
        "none",
        description="Compression of the gradients replicas all-reduce: 'fp16'/'bf16' "
        "halve the all-reduced bytes ('bf16' on NCCL only), 'powersgd' sends a rank-1 "
        "approximation, 'topk' the largest `topk_ratio` of the entries (values + indices); "
        "both with error feedback. DDP applies it as a communication hook; tp replicas (dp "
        "> 1) to their averaged gradient shards (not 'powersgd'). Counts the bytes it sends.",
    )
    topk_ratio: float = Field(
        0.01, gt=0, le=0.5, description="Share of gradient entries 'topk' compression sends."
    )
    local_sgd_period: int = Field(
        LOCAL_SGD_PERIOD, ge=1, description="'local_sgd': steps between parameter averages (H)."
    )
    staleness: int = Field(
        STALENESS, ge=0, description="'ssp': most steps a worker may run ahead of the slowest."
    )
    staleness_lr: bool = Field(
        False,
        description="'async'/'ssp': divide an update's learning rate by its staleness.",
    )
    ps_shards: int = Field(
        PS_SHARDS,
        ge=1,
        description="'async'/'ssp': parameter-server actors the model is split over.",
    )
    straggler: StragglerConfig | None = Field(
        None,
        description="Make workers slow on purpose: {rank (one or a list taking turns), "
        "every, delay_s, first_epoch, last_epoch}; see docs/guides/consistency.md.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy of the worker group."
    )

    @model_validator(mode="before")
    @classmethod
    def _worker_range(cls, data):
        """`workers: {min, max}` -> `workers: max, min_workers: min`."""
        if not isinstance(data, dict) or not isinstance(data.get("workers"), dict):
            return data
        span = data["workers"]
        if set(span) != {"min", "max"}:
            raise ValueError(f"workers as a range takes exactly min and max (got {sorted(span)})")
        if data.get("min_workers") is not None:
            raise ValueError("give min_workers or workers: {min, max}, not both")
        return {**data, "workers": span["max"], "min_workers": span["min"]}

    @model_validator(mode="before")
    @classmethod
    def _from_degrees(cls, data):
        """A layout given by its degrees (no `strategy`, or `dp_shard` / `sync`): the strategy
        name is the preset those degrees make, the sync's settings its fields. A strategy given
        beside degrees must be the one they make."""
        if not isinstance(data, dict):
            return data
        if data.get("strategy") is not None and all(data.get(k) is None for k in DEGREE_KEYS):
            return data
        return {**data, **resolve_degrees(data)}

    @cached_property
    def dims(self) -> ParallelDims:
        """The layout this section asks for (its strategy name is a preset), built once per
        config and handed down: every reader of the degrees reads this one."""
        return ParallelDims.from_parallelism(self)

    @property
    def elastic(self) -> bool:
        """Whether the worker count may change during the run."""
        return self.min_workers is not None

    @model_validator(mode="after")
    def _forget_layout(self) -> ParallelismConfig:
        """Validation runs again when a field is assigned: the cached layout is rebuilt."""
        self.__dict__.pop("dims", None)
        return self

    @model_validator(mode="after")
    def _check_resources(self) -> ParallelismConfig:
        if self.min_workers is not None and self.min_workers > self.workers:
            raise ValueError(f"workers: min ({self.min_workers}) is above max ({self.workers})")
        for name, amount in self.resources_per_worker.items():
            if amount < 0:
                raise ValueError(f"resources_per_worker.{name} must not be negative")
        if self.use_gpu and self.resources_per_worker.get("GPU", 1) == 0:
            raise ValueError("use_gpu is true but resources_per_worker.GPU is 0")
        return self


def _check_hsdp(replicas: int, shard: int, split: int, sync: SyncConfig, elastic: bool) -> None:
    """HSDP (replicas of a sharded model: FSDP2 over a replicate x shard mesh) as far as it is
    proven: on its own, synchronised by FSDP2's own all-reduce, at a fixed size."""
    layout = f"dp {replicas} replicas of dp_shard {shard} shards (HSDP)"
    if split > 1:
        raise ValueError(
            f"{layout} with pipeline stages, tensor or context parallelism is not available "
            "yet: give dp_shard = workers / (pp * tp * cp), or pp = tp = cp = 1"
        )
    if sync.kind != "all_reduce" or sync.compression != "none":
        raise ValueError(
            f"{layout} synchronises by FSDP2's own reduce-scatter and all-reduce: sync "
            f"{sync.kind} with compression {sync.compression} is not available with it"
        )
    if elastic:
        raise ValueError(
            f"{layout} runs at a fixed size: give workers as one number, without min_workers"
        )


def resolve_degrees(data: dict) -> dict:
    """`strategy`, `dp` and the sync's fields for a `parallelism:` mapping given by degrees."""
    try:
        sync = SyncConfig.model_validate(data.get("sync") or {})
    except ValidationError:
        return {}  # the `sync` field's own validation names the problem, where it is
    pp, tp, cp = (int(data.get(k, 1)) for k in ("pp", "tp", "cp"))
    shard = int(data.get("dp_shard") or 1)
    split = pp * tp * cp * shard
    workers = data.get("workers", split)
    if isinstance(workers, dict):  # an elastic range: its largest size
        workers = workers.get("max", 1)
    if int(workers) % split:
        raise ValueError(
            f"workers ({workers}) is not divisible by dp_shard * pp * tp * cp ({split})"
        )
    given_dp = int(data.get("dp", 1))
    if pp > 1 and shard > 1:  # each stage sharded: `dp` counts a stage's shards
        replicas = int(workers) // split
        if given_dp not in (1, shard):
            raise ValueError(
                f"dp {given_dp}: with pipeline stages and dp_shard, dp is each stage's shards "
                f"(dp_shard {shard})"
            )
    else:
        replicas = given_dp if pp > 1 else int(workers) // split
    if pp == 1 and given_dp not in (1, replicas * shard):
        raise ValueError(
            f"dp {given_dp}: without stages the data-parallel workers are workers / (tp * cp) "
            f"= {replicas * shard}"
        )
    if shard > 1 and replicas > 1:
        elastic = isinstance(data.get("workers"), dict) or data.get("min_workers") is not None
        _check_hsdp(replicas, shard, pp * tp * cp, sync, elastic)
    dims = ParallelDims(
        dp_replicate=replicas, dp_shard=shard, pp=pp, tp=tp, cp=1 if pp > 1 else cp,
        sync=Sync(sync.kind, sync.compression, sync.period, sync.staleness, sync.shards),
    )  # fmt: skip
    name = dims.preset_name
    given = data.get("strategy")
    if given is not None and given != name:
        raise ValueError(
            f"strategy '{given}' is not the layout its degrees make ({dims.describe()}: "
            f"'{name}'); give one or the other"
        )
    resolved = {"strategy": name, "dp": dims.dp, "workers": data.get("workers", split)}
    return resolved | (sync.as_fields() if data.get("sync") is not None else {})
