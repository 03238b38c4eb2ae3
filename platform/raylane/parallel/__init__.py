"""Parallelism strategies. The train loop asks the registry; it never branches on a name.

The registry reads the validated config (pydantic) and is imported on first use, so the
torch-only modules (`raylane.parallel.base`, `parallelize`, `precision`) import on a machine
that has torch and nothing else (`benchmarks/gpu.py` runs there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raylane.parallel.base import ParallelStrategy
    from raylane.parallel.registry import available_strategies, get_strategy, splits_dataset

__all__ = ["ParallelStrategy", "available_strategies", "get_strategy", "splits_dataset"]


def __getattr__(name: str):
    if name in __all__:
        # lazy: the registry needs pydantic; the torch-only modules import without it
        from raylane.parallel import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'raylane.parallel' has no attribute {name!r}")
