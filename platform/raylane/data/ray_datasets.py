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
        dataset = ray.data.read_parquet(str(Path(path).resolve()), columns=columns)
        datasets[name] = dataset.materialize() if cfg.data.cache else dataset
    return datasets
