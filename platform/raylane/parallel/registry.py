"""Maps strategy names from the config to their implementations."""

from __future__ import annotations

from raylane.config import RaylaneConfig
from raylane.parallel.base import ParallelStrategy


def _strategies() -> dict[str, type]:
    from raylane.parallel.async_sgd import ParameterServerTraining
    from raylane.parallel.ddp import DataParallel
    from raylane.parallel.fsdp import FullyShardedDataParallel
    from raylane.parallel.local_sgd import LocalSGD
    from raylane.parallel.pipeline import PipelineParallel
    from raylane.parallel.tensor_parallel import TensorParallel

    return {
        "ddp": DataParallel,
        "pipeline": PipelineParallel,
        "hybrid": PipelineParallel,
        "tp": TensorParallel,
        "fsdp": FullyShardedDataParallel,
        "local_sgd": LocalSGD,
        "async": ParameterServerTraining,
        "ssp": ParameterServerTraining,
    }


def available_strategies() -> list[str]:
    return sorted(_strategies())


def splits_dataset(name: str) -> bool:
    """Whether Ray Train should shard the datasets across the workers of this strategy."""
    return _strategies()[name].splits_dataset


def get_strategy(cfg: RaylaneConfig, rank: int) -> ParallelStrategy:
    """The configured strategy for the worker of global `rank` (process group initialised)."""
    name = cfg.parallelism.strategy
    try:
        strategy = _strategies()[name]
    except KeyError:
        raise ValueError(
            f"unknown parallelism strategy {name!r}; available: {', '.join(available_strategies())}"
        ) from None
    return strategy(cfg, rank)
