"""Parallelism strategies. The train loop asks the registry; it never branches on a name."""

from raylane.parallel.base import ParallelStrategy
from raylane.parallel.registry import available_strategies, get_strategy, splits_dataset

__all__ = ["ParallelStrategy", "available_strategies", "get_strategy", "splits_dataset"]
