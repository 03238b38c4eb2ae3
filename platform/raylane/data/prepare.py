"""Materialise the reference dataset (scikit-learn's bundled digits) as Parquet.

The digits ship inside scikit-learn (1,797 8x8 images), so preparing needs no download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raylane.config import DataConfig


@dataclass(frozen=True)
class PreparedSplit:
    path: Path
    rows: int


def _column(values: np.ndarray) -> pa.Array:
    """1-D arrays become scalar columns, 2-D arrays fixed-size list columns."""
    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def write_split(path: Path, features: np.ndarray, labels: np.ndarray, cfg: DataConfig) -> None:
    """Write one split: features `[N, F]` (their dtype kept) and labels `[N]` or `[N, T]`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            cfg.features_column: _column(features),
            cfg.label_column: _column(labels.astype(np.int64)),
        }
    )
    # Write to a temporary name first so an interrupted prepare never leaves a half file.
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def prepare_digits(cfg: DataConfig) -> tuple[PreparedSplit, PreparedSplit]:
    """Split the digits deterministically (stratified, `cfg.split_seed`) and write both splits."""
    # lazy: scikit-learn is heavy and only the digits dataset needs it
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        digits.data,
        digits.target,
        test_size=cfg.validation_fraction,
        random_state=cfg.split_seed,
        stratify=digits.target,
    )
    write_split(cfg.train_path, x_train.astype(np.float32), y_train, cfg)
    write_split(cfg.validation_path, x_val.astype(np.float32), y_val, cfg)
    return PreparedSplit(cfg.train_path, len(y_train)), PreparedSplit(
        cfg.validation_path, len(y_val)
    )
