"""One parallel layout: the degrees a job's workers are split by, and how replicas agree.

A layout is `dp_replicate x dp_shard x pp x cp x tp` workers: data-parallel replicas that each
hold the whole model, data-parallel workers that shard its parameters, gradients and optimizer
state (FSDP), pipeline stages, workers that split each sequence (context parallelism: same
rows, different positions) and tensor-parallel workers per block. `Sync` says how the
data-parallel workers agree: an all-reduce of every gradient (optionally compressed), a
periodic average of the parameters (local SGD), or a parameter server (asynchronous, or with
bounded staleness).

Every strategy name a config gives (`parallelism.strategy`) is a preset of this type
(`ParallelDims.from_parallelism`), so configs, README commands and MLflow records keep their
names while the degrees, the ranks' coordinates and the description come from one place.
The mesh itself is built by `raylane.parallel.mesh.build_device_mesh`; this module is pure
Python so that configs validate without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from raylane.config.presets import PRESETS, SyncKind

if TYPE_CHECKING:
    from raylane.config.parallelism import ParallelismConfig

#: Mesh dimensions, outermost first: the workers of one tensor-parallel group are neighbouring
#: ranks (one node when a node holds a multiple of tp), then the stages, then the replicas.
MESH_DIMS = ("dp_replicate", "dp_shard", "pp", "cp", "tp")


@dataclass(frozen=True)
class Sync:
    """How data-parallel workers agree on one model."""

    kind: SyncKind = "all_reduce"
    #: all_reduce: a DDP communication hook ('none', 'fp16', 'bf16', 'powersgd', 'topk').
    compression: str = "none"
    #: periodic_average: steps between parameter averages.
    period: int = 1
    #: parameter_server: steps a worker may run ahead of the slowest (None: unbounded).
    staleness: int | None = None
    #: parameter_server: actors the parameters are split over.
    shards: int = 1

    def describe(self) -> str:
        if self.kind == "periodic_average":
            return f"parameters averaged every {self.period} steps"
        if self.kind == "parameter_server":
            bound = "unbounded" if self.staleness is None else f"at most {self.staleness}"
            return f"parameter server on {self.shards} shards, staleness {bound}"
        return "gradients all-reduced" + (
            f" ({self.compression} compressed)" if self.compression != "none" else ""
        )


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one layout; their product is the job's worker count."""

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    sync: Sync = field(default_factory=Sync)
    #: Tensor-parallel blocks' norms and residual adds on sequence shards (needs tp > 1).
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            if getattr(self, name) < 1:
                raise ValueError(f"layout: {name} must be at least 1 (got {getattr(self, name)})")
        if self.cp > 1 and (self.dp_shard > 1 or self.pp > 1):
            raise ValueError(
                f"layout: context parallelism (cp {self.cp}) combines with data-parallel "
                "replicas and tensor parallelism, not yet with FSDP or pipeline stages"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "layout: sequence parallelism splits the sequence inside tensor-parallel blocks; "
                "it needs tp > 1"
            )

    @classmethod
    def from_parallelism(cls, par: ParallelismConfig) -> ParallelDims:
        """The layout a `parallelism:` section asks for; its strategy name is a preset
        (`raylane.config.presets.PRESETS`). Without pipeline stages `dp: 1` reads as
        workers / (tp * cp), as the config documents."""
        preset = PRESETS[par.strategy]
        dp = par.workers // (par.tp * par.cp) if par.dp == 1 and par.pp == 1 else par.dp
        if preset.sync == "periodic_average":
            sync = Sync(preset.sync, period=par.local_sgd_period)
        elif preset.sync == "parameter_server":
            staleness = par.staleness if preset.bounded else None
            sync = Sync(preset.sync, staleness=staleness, shards=par.ps_shards)
        else:
            sync = Sync(compression=par.grad_compression)
        dims = cls.preset(par.strategy, dp=dp, pp=par.pp, tp=par.tp, sync=sync)
        if par.dp_shard is not None and dims.dp_shard > par.dp_shard > 1:
            # HSDP: the sharding workers split into replicas of `dp_shard` shards each.
            replicas = dims.dp_shard // par.dp_shard
            dims = replace(dims, dp_replicate=replicas, dp_shard=par.dp_shard)
        return replace(dims, cp=par.cp, sequence_parallel=par.sequence_parallel)

    @classmethod
    def preset(
        cls, strategy: str, *, dp: int, pp: int = 1, tp: int = 1, sync: Sync | None = None
    ) -> ParallelDims:
        """The layout strategy `strategy` names with `dp` data-parallel workers: sharded
        (FSDP, each stage's with pp > 1) where its preset shards, replicated otherwise."""
        if PRESETS[strategy].shard:
            return cls(dp_shard=dp, pp=pp, tp=tp)
        return cls(dp_replicate=dp, pp=pp, tp=tp, sync=sync or Sync())

    @property
    def preset_name(self) -> str:
        """The config strategy name that resolves to this layout (`preset`'s inverse)."""
        if self.sync.kind == "periodic_average":
            return "local_sgd"
        if self.sync.kind == "parameter_server":
            return "async" if self.sync.staleness is None else "ssp"
        if self.dp_shard > 1:
            return "fsdp"
        if self.pp > 1:
            return "hybrid" if self.dp_replicate > 1 else "pipeline"
        return "tp" if self.tp > 1 else "ddp"

    @classmethod
    def candidates(
        cls, devices: int, tps: Sequence[int], pps: Sequence[int], cps: Sequence[int] = (1,)
    ) -> list[ParallelDims]:
        """Every layout of exactly `devices` workers with tp in `tps`, pp in `pps` and cp in
        `cps`: for each (pp, tp) that divides the devices, the data-parallel workers
        replicated, and (with more than one) sharded instead, and without stages or tensor
        parallelism as replicas of the model sharded over a divisor of them (HSDP); each
        sequence split over cp > 1 workers only where context parallelism runs, on replicas
        without pipeline stages.
        Whether the sequence divides into 2 * cp chunks is the caller's to check. The planner
        enumerates these."""
        found = []
        for tp in tps:
            for pp in pps:
                if devices % (tp * pp):
                    continue
                dp = devices // (tp * pp)
                found.append(cls(dp_replicate=dp, pp=pp, tp=tp))
                if dp > 1:
                    found.append(cls(dp_shard=dp, pp=pp, tp=tp))
                if pp == tp == 1:  # HSDP: replicas of the model sharded over `shard` workers
                    found += [
                        cls(dp_replicate=dp // shard, dp_shard=shard)
                        for shard in range(2, dp)
                        if dp % shard == 0
                    ]
                if pp == 1:
                    found += [
                        cls(dp_replicate=dp // cp, tp=tp, cp=cp)
                        for cp in cps
                        if cp > 1 and dp % cp == 0
                    ]
        return found

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.tp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel workers: each reads different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def replicates_split_model(self) -> bool:
        """Whether replicas of a split but unsharded model (tensor parallel, pipeline stages,
        context parallel) all-reduce their gradients inside backward, by FSDP2's `replicate`:
        there are replicas (`dp_replicate x cp`), nothing is sharded and the sync is the
        plain all-reduce (a compressed one is the strategy's own). FSDP2 then holds a second,
        unsharded copy of those parameters from forward to the end of backward."""
        split = self.tp > 1 or self.pp > 1 or self.cp > 1
        plain = self.sync.kind == "all_reduce" and self.sync.compression == "none"
        return split and not self.fsdp_enabled and self.dp_replicate * self.cp > 1 and plain

    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on each mesh dimension (row-major over MESH_DIMS)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} workers")
        coords = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in MESH_DIMS}

    def data_rank(self, rank: int) -> int:
        """Which data-parallel worker `rank` is: the part of each global batch it trains on."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    def describe(self) -> str:
        """One line for the console and MLflow, e.g. 'dp 2 x pp 2 x tp 2 (8 workers): ...'."""
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"dp {self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"dp_shard {self.dp_shard}")
        if self.pp > 1:
            parts.append(f"pp {self.pp}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.tp > 1:
            parts.append(
                f"tp {self.tp}" + (" (sequence-parallel)" if self.sequence_parallel else "")
            )
        workers = self.world_size
        line = f"{' x '.join(parts)} ({workers} workers)" if parts else "1 worker"
        if self.dp_shard > 1 and self.dp_replicate > 1:  # HSDP
            return f"{line}: gradients reduce-scattered, shards all-reduced over the replicas"
        if self.dp_shard > 1:  # FSDP: each worker ends a step with its shard of the gradients
            return f"{line}: gradients reduce-scattered"
        return f"{line}: {self.sync.describe()}" if self.dp > 1 else line

    def as_params(self) -> dict[str, str]:
        """MLflow params under `layout.`: every degree and the synchronisation."""
        params = {f"layout.{name}": str(getattr(self, name)) for name in MESH_DIMS}
        params["layout.sync"] = self.sync.kind
        params["layout.sequence_parallel"] = str(self.sequence_parallel).lower()
        return params
