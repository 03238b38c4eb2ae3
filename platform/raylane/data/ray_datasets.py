"""The configured Parquet splits as Ray Train reads them: object-store arrays or Ray Datasets."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.parquet as pq

from raylane.config import RaylaneConfig
from raylane.data.memory import put_split

# Splits up to this size (on disk) are fed from memory under `data.feed: auto`.
MEMORY_FEED_BYTES = 64 * 2**20
# Parquet splits up to this size (on disk) are read by the driver itself when cached.
IN_DRIVER_READ_BYTES = 256 * 2**20


def uses_memory_feed(cfg: RaylaneConfig) -> bool:
    """Whether the workers read both splits from object-store arrays (`raylane.data.memory`)."""
    data = cfg.data
    if data.feed != "auto":
        return data.feed == "memory"
    paths = (Path(data.train_path).resolve(), Path(data.validation_path).resolve())
    return data.cache and sum(_size(p) for p in paths) <= MEMORY_FEED_BYTES


def read_datasets(cfg: RaylaneConfig) -> dict:
    """`{"train": ..., "validation": ...}` with only the two configured columns.

    Each is a `MemorySplit` under the memory feed, else a Ray Dataset; with `data.cache`, the
    Datasets are materialised once in Ray's object store, so epochs after the first do not
    re-read Parquet.
    """
    splits = (("train", cfg.data.train_path), ("validation", cfg.data.validation_path))
    if uses_memory_feed(cfg):
        return {name: put_split(name, Path(path).resolve(), cfg) for name, path in splits}
    import ray.data  # lazy: Ray Data is heavy and the memory feed does without it

    # Ray Data logs every execution at INFO in the driver; keep the console readable.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    columns = [cfg.data.features_column, cfg.data.label_column]
    datasets = {}
    for name, path in splits:
        path = Path(path).resolve()
        if cfg.data.cache and _size(path) <= IN_DRIVER_READ_BYTES:
            # Small enough to read here: one Arrow table put in the object store is already
            # materialised, without read tasks (each a worker process importing Ray Data,
            # pandas and pyarrow: seconds on a small machine, for milliseconds of reading).
            datasets[name] = ray.data.from_arrow(pq.read_table(path, columns=columns))
            continue
        dataset = ray.data.read_parquet(str(path), columns=columns)
        datasets[name] = dataset.materialize() if cfg.data.cache else dataset
    return datasets


def _size(path: Path) -> int:
    files = [path] if path.is_file() else list(path.rglob("*.parquet"))
    return sum(f.stat().st_size for f in files)
