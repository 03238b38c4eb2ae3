"""Read the configured Parquet splits as Ray Datasets for Ray Train."""

from __future__ import annotations

from pathlib import Path

from raylane.config import RaylaneConfig


def read_datasets(cfg: RaylaneConfig) -> dict:
    """`{"train": Dataset, "validation": Dataset}` with only the two configured columns.

    With `data.cache`, both are materialised once in Ray's object store, so epochs after the
    first do not re-read Parquet.
    """
    import logging

    import ray.data

    # Ray Data logs every execution at INFO in the driver; keep the console readable.
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    columns = [cfg.data.features_column, cfg.data.label_column]
    datasets = {}
    for name, path in (("train", cfg.data.train_path), ("validation", cfg.data.validation_path)):
        path = Path(path).resolve()
        if cfg.data.cache and _size(path) <= IN_DRIVER_READ_BYTES:
            # Small enough to read here: one Arrow table put in the object store is already
            # materialised, without read tasks (each a worker process importing Ray Data,
            # pandas and pyarrow: seconds on a small machine, for milliseconds of reading).
            import pyarrow.parquet as pq

            datasets[name] = ray.data.from_arrow(pq.read_table(path, columns=columns))
            continue
        dataset = ray.data.read_parquet(str(path), columns=columns)
        datasets[name] = dataset.materialize() if cfg.data.cache else dataset
    return datasets


# Parquet splits up to this size (on disk) are read by the driver itself when cached.
IN_DRIVER_READ_BYTES = 256 * 2**20


def _size(path: Path) -> int:
    files = [path] if path.is_file() else list(path.rglob("*.parquet"))
    return sum(f.stat().st_size for f in files)
