"""Maps strategy names from the config to their implementations."""

from __future__ import annotations

from raylane.config import RaylaneConfig
from raylane.config.parallelism import ParallelismConfig
from raylane.parallel.base import ParallelStrategy

# Where each strategy lives: a job imports only its own (the FSDP, DTensor and pipelining
# modules cost a worker seconds of imports that a DDP run never uses).
_STRATEGIES = {
    "ddp": "raylane.parallel.ddp:DataParallel",
    "pipeline": "raylane.parallel.pipeline:PipelineParallel",
    "hybrid": "raylane.parallel.pipeline:PipelineParallel",
    "tp": "raylane.parallel.mesh_parallel:MeshParallel",
    "fsdp": "raylane.parallel.mesh_parallel:MeshParallel",
    "local_sgd": "raylane.parallel.local_sgd:LocalSGD",
    "async": "raylane.parallel.async_sgd:ParameterServerTraining",
    "ssp": "raylane.parallel.async_sgd:ParameterServerTraining",
}


def _strategy_class(name: str) -> type:
    import importlib

    try:
        module, _, attribute = _STRATEGIES[name].partition(":")
    except KeyError:
        raise ValueError(
            f"unknown parallelism strategy {name!r}; available: {', '.join(available_strategies())}"
        ) from None
    return getattr(importlib.import_module(module), attribute)


def available_strategies() -> list[str]:
    return sorted(_STRATEGIES)


def splits_dataset(par: ParallelismConfig) -> bool:
    """Whether Ray Train should shard the datasets across the workers of this layout (never
    with context parallelism: a sequence's chunks are read by several workers; never in an
    elastic run: every worker reads the same global batches, whatever their number)."""
    return (
        not par.dims.cp_enabled and not par.elastic and _strategy_class(par.strategy).splits_dataset
    )


def get_strategy(cfg: RaylaneConfig, rank: int) -> ParallelStrategy:
    """The configured strategy for the worker of global `rank` (process group initialised).

    The one branch on the layout: with pipeline stages a schedule drives each step (whatever
    else each stage is: replicated, tensor parallel, sharded); otherwise the strategy named."""
    dims = cfg.parallelism.dims
    if dims.pp_enabled:
        return _strategy_class("pipeline")(cfg, rank)
    if dims.cp_enabled:  # sequences split over workers: a mesh of replicas x cp (x tp)
        return _strategy_class("tp")(cfg, rank)
    return _strategy_class(cfg.parallelism.strategy)(cfg, rank)
