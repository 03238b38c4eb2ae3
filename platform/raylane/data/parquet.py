"""Checks and digests of Parquet datasets, done in the driver before any compute is spent."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raylane.config import RaylaneConfig
from raylane.console import long_step
from raylane.data.errors import DataError
from raylane.data.files import prepare_files, stale_sources
from raylane.data.packing import IGNORE_INDEX
from raylane.data.prepare import prepare_digits
from raylane.data.text import prepare_stdlib_text


@dataclass(frozen=True)
class DatasetInfo:
    path: Path
    rows: int
    features: int


def parquet_files(path: Path) -> list[Path]:
    """The Parquet files behind `path` (a file, or a directory of them), sorted."""
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*.parquet") if p.is_file())
    return []


def dataset_digest(*paths: Path) -> str:
    """sha256 over the bytes of every file of the given datasets (first 16 hex digits)."""
    digest = hashlib.sha256()
    for path in paths:
        for file in parquet_files(path):
            digest.update(file.name.encode())
            with file.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def read_rows(
    path: Path, cfg: RaylaneConfig, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The first `limit` rows (all when None): features `[N, F]` (float32, or int64 tokens) and
    int64 labels `[N]` (or `[N, T]` for sequence targets)."""
    columns = [cfg.data.features_column, cfg.data.label_column]
    table = pq.read_table(parquet_files(Path(path)), columns=columns)
    if limit is not None:
        table = table.slice(0, limit)
    features = as_matrix(table.column(0).to_numpy(zero_copy_only=False))
    labels = table.column(1).to_numpy(zero_copy_only=False)
    labels = as_matrix(labels) if labels.dtype == object else labels
    return features, labels.astype(np.int64)


def as_matrix(column: np.ndarray) -> np.ndarray:
    """A list column as a 2-D array: float32 for real features, int64 for token ids.

    Fixed-size lists arrive as 2-D arrays, variable-size lists as object arrays of rows.
    """
    if column.dtype == object:
        column = np.stack(column)
    dtype = np.int64 if np.issubdtype(column.dtype, np.integer) else np.float32
    return np.ascontiguousarray(column, dtype=dtype)


def _feature_width(path: Path, column: pa.ChunkedArray) -> int:
    kind = column.type
    if pa.types.is_fixed_size_list(kind):
        return kind.list_size
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = pc.unique(pc.list_value_length(column)).to_pylist()
        if len(lengths) != 1:
            raise DataError(f"{path}: feature rows have different lengths {sorted(lengths)[:5]}")
        return lengths[0]
    raise DataError(f"{path}: features column must hold lists of numbers, found {kind}")


def check_parquet(path: Path, cfg: RaylaneConfig) -> DatasetInfo:
    """Check that `path` holds the configured columns with the model's feature width, and
    labels in [0, model.num_classes), sequence labels also -100 (positions the loss skips)."""
    files = parquet_files(path)
    if not files:
        raise DataError(f"{path}: no Parquet files found")
    features_col, label_col = cfg.data.features_column, cfg.data.label_column
    try:
        table = pq.read_table(files, columns=[features_col, label_col])
    except (pa.ArrowInvalid, KeyError) as exc:
        schema = pq.read_schema(files[0])
        missing = [c for c in (features_col, label_col) if c not in schema.names]
        if missing:
            raise DataError(
                f"{path}: column {missing[0]!r} not found (columns: {', '.join(schema.names)})"
            ) from None
        raise DataError(f"{path}: unreadable Parquet ({exc})") from None
    if table.num_rows == 0:
        raise DataError(f"{path}: dataset is empty")
    width = _feature_width(path, table.column(features_col))
    if width != cfg.model.input_dim:
        raise DataError(
            f"{path}: rows have {width} features but model.input_dim is {cfg.model.input_dim}"
        )
    labels = table.column(label_col)
    sequences = pa.types.is_fixed_size_list(labels.type) or pa.types.is_list(labels.type)
    if sequences:
        # Sequence targets (language modelling): one label per input position.
        if _feature_width(path, labels) != width:
            raise DataError(f"{path}: label sequences must have {width} entries like the inputs")
        labels = pc.list_flatten(labels)
    if not pa.types.is_integer(labels.type):
        raise DataError(f"{path}: label column {label_col!r} must be integer, found {labels.type}")
    if sequences:
        # Positions the loss skips carry -100 (PyTorch's ignore_index): a prompt, a user turn.
        labels = pc.filter(labels, pc.not_equal(labels, IGNORE_INDEX))
        if len(labels) == 0:
            raise DataError(f"{path}: every label is {IGNORE_INDEX} (ignored): nothing to learn")
    low, high = pc.min(labels).as_py(), pc.max(labels).as_py()
    if low is None or low < 0 or high >= cfg.model.num_classes:
        raise DataError(
            f"{path}: labels span [{low}, {high}] but model.num_classes is {cfg.model.num_classes}"
        )
    return DatasetInfo(path=path, rows=table.num_rows, features=width)


def ensure_dataset(cfg: RaylaneConfig) -> tuple[DatasetInfo, DatasetInfo]:
    """Make sure both splits exist and fit the model; prepare a built-in dataset if missing,
    the user's files (`data.source: files`) if missing or built from anything else."""
    data = cfg.data
    missing = [p for p in (data.train_path, data.validation_path) if not parquet_files(p)]
    if missing and data.source == "sklearn-digits":
        with long_step("preparing the digits dataset"):
            prepare_digits(data)
    elif missing and data.source in ("python-stdlib", "python-stdlib-tests"):
        with long_step("preparing the standard-library text dataset"):
            prepare_stdlib_text(cfg)
    elif data.source == "files":
        # Checked every time: a changed file, tokenizer or data field re-prepares.
        sources = stale_sources(cfg)
        if sources is not None:
            with long_step(f"preparing {len(sources.files)} data files"):
                prepare_files(cfg, sources)
    elif missing:
        raise DataError(f"{missing[0]}: no Parquet files found (data.source is 'parquet')")
    return check_parquet(data.train_path, cfg), check_parquet(data.validation_path, cfg)
