"""Maps strategy names from the config to their implementations."""

from __future__ import annotations

from raylane.parallel.base import ParallelStrategy
from raylane.parallel.ddp import DataParallel

_STRATEGIES: dict[str, type] = {DataParallel.name: DataParallel}


def available_strategies() -> list[str]:
    return sorted(_STRATEGIES)


def get_strategy(name: str) -> ParallelStrategy:
    try:
        return _STRATEGIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown parallelism strategy {name!r}; available: {', '.join(available_strategies())}"
        ) from None
