"""Splits that fit in memory, fed to Ray Train workers straight from Ray's object store.

Ray Data streams datasets of any size, but each run pays for its machinery before the first
batch: a dataset manager and, for data-parallel shards, a split coordinator (actors, each a
process importing Ray Data), and every worker's own Ray Data import. For splits that fit in
memory that start-up is most of a small job's data time. Here the driver reads each split once
into two arrays put in the object store; every worker maps the same arrays (zero-copy on one
node) and takes its part of each global batch, in an order every worker derives from the same
seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raylane.config import RaylaneConfig
from raylane.data.parquet import read_rows


@dataclass
class MemorySplit:
    """One split as two object-store arrays: features `[N, F]` and labels `[N]` or `[N, T]`."""

    name: str
    rows: int
    features_ref: Any
    labels_ref: Any
    _arrays: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The arrays, fetched once per process (read-only views of the object store)."""
        if self._arrays is None:
            import ray  # lazy: Ray is heavy, and memory_batches (and its tests) run without it

            self._arrays = (ray.get(self.features_ref), ray.get(self.labels_ref))
        return self._arrays

    def __getstate__(self) -> dict:
        # Workers receive the references, never the driver's fetched arrays.
        return {**self.__dict__, "_arrays": None}


def put_split(name: str, path: Path, cfg: RaylaneConfig) -> MemorySplit:
    """Read a Parquet split in the driver and put its arrays in Ray's object store."""
    import ray  # lazy: Ray is heavy, and memory_batches (and its tests) run without it

    features, labels = read_rows(path, cfg)
    return MemorySplit(name, len(labels), ray.put(features), ray.put(labels))


def memory_batches(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    batch_size: int,
    part: int = 0,
    parts: int = 1,
    shuffle_seed: int | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Any, Any]]:
    """`(features, labels)` torch batches: this worker's `part` of `parts` of each global batch.

    Global batches hold `batch_size * parts` rows, in row order or, with `shuffle_seed`, in a
    permutation drawn from it: every worker given the same seed sees the same global batches,
    and the parts of one global batch are disjoint and together the whole of it. A partial last
    batch is split the same way; it is dropped with `drop_last`, or when it has fewer rows than
    there are parts (every data-parallel replica must take the same number of steps).
    """
    import torch  # lazy: torch is heavy and the driver reads splits without it

    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts}: must be in 0..{parts - 1}")
    count = len(labels)
    order = (
        np.arange(count)
        if shuffle_seed is None
        else np.random.default_rng(shuffle_seed).permutation(count)
    )
    rows_per_batch = batch_size * parts
    for start in range(0, count, rows_per_batch):
        rows = order[start : start + rows_per_batch]
        if len(rows) < rows_per_batch and (drop_last or len(rows) < parts):
            break
        mine = rows[part * len(rows) // parts : (part + 1) * len(rows) // parts]
        # Fancy indexing copies: the tensors are writable, the object store's arrays are not.
        yield torch.from_numpy(features[mine]), torch.from_numpy(labels[mine])
