"""Checks and digests of Parquet datasets, done in the driver before any compute is spent."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
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
from raylane.data.streaming import prepare_streaming
from raylane.data.text import prepare_stdlib_text

#: Rows per record batch `check_parquet` reads at once.
CHECK_BATCH_ROWS = 1024


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
    files = parquet_files(Path(path))
    table = pq.read_table(files, columns=columns) if limit is None else _head(files, columns, limit)
    features = as_matrix(table.column(0).to_numpy(zero_copy_only=False))
    labels = table.column(1).to_numpy(zero_copy_only=False)
    labels = as_matrix(labels) if labels.dtype == object else labels
    return features, labels.astype(np.int64)


def _head(files: list[Path], columns: list[str], limit: int) -> pa.Table:
    """The first `limit` rows, reading no more record batches than they need."""
    tables, rows = [], 0
    for file in files:
        if rows >= limit:
            break
        for batch in pq.ParquetFile(file).iter_batches(batch_size=max(limit, 1), columns=columns):
            tables.append(pa.Table.from_batches([batch]))
            rows += batch.num_rows
            if rows >= limit:
                break
    if rows < limit or not tables:  # fewer rows than `limit` (or none asked): read as a whole
        return pq.read_table(files, columns=columns).slice(0, limit)
    # Files of one split may differ in their list types: unified as `read_table` does.
    return pa.concat_tables(tables, promote_options="default").slice(0, limit)


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
    labels in [0, model.num_classes), sequence labels also -100 (positions the loss skips).
    Read one record batch at a time: a split larger than the driver's memory is checked too."""
    files = parquet_files(path)
    if not files:
        raise DataError(f"{path}: no Parquet files found")
    try:
        width, rows, learnt, low, high = _scan(path, files, cfg)
    finally:
        # The pages the pass read into go back to the system: Arrow's allocator keeps them
        # otherwise, and the driver would hold them (about 50 MB) through the whole run.
        pa.default_memory_pool().release_unused()
    if rows == 0:
        raise DataError(f"{path}: dataset is empty")
    if learnt == 0:
        raise DataError(f"{path}: every label is {IGNORE_INDEX} (ignored): nothing to learn")
    if low is None or low < 0 or high >= cfg.model.num_classes:
        raise DataError(
            f"{path}: labels span [{low}, {high}] but model.num_classes is {cfg.model.num_classes}"
        )
    return DatasetInfo(path=path, rows=rows, features=width)


def _scan(path: Path, files: list[Path], cfg: RaylaneConfig) -> tuple:
    """One pass over a split: its feature width, rows, learnt labels and label range."""
    rows, width, low, high, learnt = 0, None, None, None, 0
    for table in _column_batches(path, files, cfg):
        rows += table.num_rows
        batch_width = _feature_width(path, table.column(0))
        if width not in (None, batch_width):
            raise DataError(f"{path}: feature rows have different lengths {[width, batch_width]}")
        width = batch_width
        if width != cfg.model.input_dim:
            raise DataError(
                f"{path}: rows have {width} features but model.input_dim is {cfg.model.input_dim}"
            )
        labels = _labels(path, table.column(1), width, cfg.data.label_column)
        learnt += len(labels)
        if len(labels):
            low = min(x for x in (low, pc.min(labels).as_py()) if x is not None)
            high = max(x for x in (high, pc.max(labels).as_py()) if x is not None)
    return width, rows, learnt, low, high


def _column_batches(path: Path, files: list[Path], cfg: RaylaneConfig) -> Iterator[pa.Table]:
    """The features and label columns of every file, a record batch at a time."""
    columns = [cfg.data.features_column, cfg.data.label_column]
    for file in files:
        try:
            reader = pq.ParquetFile(file)
            names = reader.schema_arrow.names
            missing = [c for c in columns if c not in names]
            if missing:
                raise DataError(
                    f"{path}: column {missing[0]!r} not found (columns: {', '.join(names)})"
                )
            # One thread: Arrow's decoding threads each keep tens of MB of this process's
            # memory after the check, for a pass that is bounded by reading, not decoding.
            batches = reader.iter_batches(
                batch_size=CHECK_BATCH_ROWS, columns=columns, use_threads=False
            )
            for batch in batches:
                yield pa.Table.from_batches([batch])
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{path}: unreadable Parquet ({exc})") from None


def _labels(path: Path, labels: pa.ChunkedArray, width: int, name: str) -> pa.ChunkedArray:
    """The labels to range-check: sequence labels flattened, the ignored (-100) left out."""
    sequences = pa.types.is_fixed_size_list(labels.type) or pa.types.is_list(labels.type)
    if sequences:
        # Sequence targets (language modelling): one label per input position.
        if _feature_width(path, labels) != width:
            raise DataError(f"{path}: label sequences must have {width} entries like the inputs")
        labels = pc.list_flatten(labels)
    if not pa.types.is_integer(labels.type):
        raise DataError(f"{path}: label column {name!r} must be integer, found {labels.type}")
    if sequences:
        # Positions the loss skips carry -100 (PyTorch's ignore_index): a prompt, a user turn.
        labels = pc.filter(labels, pc.not_equal(labels, IGNORE_INDEX))
    return labels


#: Set by a user who wants another Arrow allocator than the one `use_system_allocator` picks.
ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def use_system_allocator() -> None:
    """Arrow allocates from the C library's allocator in this process (the driver, a training
    worker), not from its default mimalloc, which keeps the pages Arrow frees: through 6,000
    steps streamed by Ray Data (benchmarks/data_pipeline.py's 80 MB corpus) a training worker
    peaked at 956 MB with mimalloc and 813 MB without. $ARROW_DEFAULT_MEMORY_POOL, where set,
    is left to choose."""
    if ARROW_POOL_ENV not in os.environ:
        pa.set_memory_pool(pa.system_memory_pool())


def ensure_dataset(cfg: RaylaneConfig) -> tuple[DatasetInfo, DatasetInfo]:
    """Make sure both splits exist and fit the model; prepare a built-in dataset if missing,
    the user's files (`data.source: files`) if missing or built from anything else. Arrow
    allocates from the system's allocator from here on (`use_system_allocator`)."""
    use_system_allocator()
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
            prepare = prepare_streaming if sources.streaming else prepare_files
            with long_step(f"preparing {len(sources.files)} data files"):
                prepare(cfg, sources)
    elif missing:
        raise DataError(f"{missing[0]}: no Parquet files found (data.source is 'parquet')")
    return check_parquet(data.train_path, cfg), check_parquet(data.validation_path, cfg)
