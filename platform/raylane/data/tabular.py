"""`data.source: files` with tables: CSV and Parquet files of one numeric column per feature and
an integer class label, prepared as the float32 feature rows `[N, F]` and int64 labels an mlp or
cnn reads.

The rows of every file are concatenated in file order and split by a seeded permutation. A row
with an empty, NaN or infinite value is named as `path:ROW: reason` (ROW: a CSV file's line, the
header line 1; a Parquet file's row, from 1); under `data.on_bad_rows: skip` it is left out and
counted. A missing or non-numeric column, or a label that is no class, stops the preparation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from raylane.config import DataConfig, RaylaneConfig
from raylane.config.data import TABLE_FORMATS
from raylane.config.families import kinds_where, named, traits
from raylane.data.corpus import AUTO_FORMATS, file_format, warn_skipped
from raylane.data.errors import DataError
from raylane.data.packing import split_indices
from raylane.data.prepare import write_split
from raylane.data.text import MANIFEST

if TYPE_CHECKING:
    from raylane.data.files import Sources

#: `path:ROW` of a table's 0-based row.
RowNamer = Callable[[int], str]


@dataclass
class Rows:
    """The good rows of every table, and `path:ROW: reason` of each row left out."""

    columns: list[str] | None = None
    features: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(len(labels) for labels in self.labels)


def is_table(files: list[Path], configured: str) -> bool:
    """Whether the files are tables (csv, parquet); an error naming the first file of another
    kind than the first file's when tables and documents mix (under format 'auto')."""
    tables = [file_format(path, configured) in TABLE_FORMATS for path in files]
    if len(set(tables)) > 1:
        odd = files[tables.index(not tables[0])]
        raise DataError(
            f"{odd}: {AUTO_FORMATS}; data.files mixes tables and documents (the first: "
            f"{files[0]}), a run reads one kind"
        )
    return bool(tables) and tables[0]


def prepare_table(cfg: RaylaneConfig, sources: Sources) -> tuple[int, int]:
    """Read every table, split the rows, write both splits and the manifest. Returns the rows
    of each split."""
    data = cfg.data
    if not traits(cfg.model.kind).tabular:
        raise DataError(
            f"data.files are tables (csv, parquet): model.kind must be "
            f"{named(kinds_where('tabular'))}, not '{cfg.model.kind}'"
        )
    rows = Rows()
    for path in sources.files:
        try:
            table = read_table(path, file_format(path, data.format))
        except DataError as exc:
            if data.on_bad_rows != "skip":
                raise
            rows.skipped.append(str(exc))
            continue
        if rows.columns is None:
            rows.columns = feature_columns(path, table, data)
            _check_width(path, rows.columns, cfg.model.input_dim)
        add_rows(rows, path, table, cfg)
    if rows.count < 2:
        raise DataError(
            f"data.files: {rows.count} table rows ({len(rows.skipped)} bad rows skipped); "
            "train and validation need at least one each"
        )
    features, labels = np.concatenate(rows.features), np.concatenate(rows.labels)
    train, validation = split_indices(len(labels), data.validation_fraction, data.split_seed)
    manifest_path = Path(data.train_path).parent / MANIFEST
    manifest_path.unlink(missing_ok=True)  # no fingerprint vouches for half-written splits
    for path, index in ((data.train_path, train), (data.validation_path, validation)):
        write_split(path, features[index], labels[index], data)
    files = [
        {**entry, "format": file_format(path, data.format)}
        for path, entry in zip(sources.files, sources.entries, strict=True)
    ]
    manifest = {
        "source": "files",
        "fingerprint": sources.fingerprint,
        "files": files,
        "feature_columns": rows.columns,
        "label_column": data.label_column,
        "rows": {"train": len(train), "validation": len(validation)},
        "skipped_rows": len(rows.skipped),
        "first_skipped": rows.skipped[0] if rows.skipped else None,
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))
    warn_skipped(rows.skipped)
    return len(train), len(validation)


def read_table(path: Path, fmt: str) -> pa.Table:
    """A CSV (types inferred, empty and NaN cells null) or Parquet file as a table."""
    try:
        if fmt == "csv":
            return pacsv.read_csv(path)
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: unreadable {fmt} ({reason})") from None


def feature_columns(path: Path, table: pa.Table, data: DataConfig) -> list[str]:
    """`data.feature_columns`, or every column of the first table but the label."""
    if data.feature_columns is not None:
        return list(data.feature_columns)
    columns = [name for name in table.column_names if name != data.label_column]
    if not columns:
        raise DataError(f"{path}: no feature columns besides the label {data.label_column!r}")
    return columns


def _check_width(path: Path, columns: list[str], input_dim: int) -> None:
    if len(columns) != input_dim:
        raise DataError(
            f"{path}: {len(columns)} feature columns {columns} but model.input_dim is {input_dim}"
        )


def add_rows(rows: Rows, path: Path, table: pa.Table, cfg: RaylaneConfig) -> None:
    """Check one table's columns and labels; add its good rows, count or raise its bad ones."""
    data, label = cfg.data, cfg.data.label_column
    names = table.column_names
    missing = [name for name in [*rows.columns, label] if name not in names]
    if missing:
        raise DataError(f"{path}: columns {missing} not found (columns: {', '.join(names)})")
    if data.feature_columns is None and set(names) - {label} != set(rows.columns):
        raise DataError(
            f"{path}: columns {sorted(set(names) - {label})} differ from the first file's "
            f"{rows.columns}; list data.feature_columns"
        )
    non_numeric = sorted(name for name in rows.columns if not _numeric(table.schema.field(name)))
    if non_numeric:
        raise DataError(
            f"{path}: non-numeric feature columns {non_numeric}; list data.feature_columns or "
            "encode them"
        )
    where = _row_namer(path, file_format(path, data.format))
    features = np.column_stack([_floats(table.column(name)) for name in rows.columns])
    labels = _label_floats(table.column(label), label, where)
    cells = np.column_stack([features, labels])
    unusable = ~np.isfinite(cells)
    bad = np.flatnonzero(unusable.any(axis=1))
    checked = [*rows.columns, label]
    reasons = []
    for i in bad:
        column = unusable[i].argmax()
        what = "empty" if np.isnan(cells[i, column]) else "infinite"
        reasons.append(f"{where(i)}: {what} value in column {checked[column]!r}")
    if reasons and data.on_bad_rows != "skip":
        raise DataError(reasons[0])
    rows.skipped.extend(reasons)
    keep = np.ones(len(labels), dtype=bool)
    keep[bad] = False
    _check_labels(labels, keep, where, cfg.model.num_classes)
    rows.features.append(features[keep].astype(np.float32))
    rows.labels.append(labels[keep].astype(np.int64))


def _numeric(column: pa.Field) -> bool:
    """Whether a feature column casts to numbers (booleans as 0 and 1; null: all empty)."""
    checks = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal)
    return any(check(column.type) for check in (*checks, pa.types.is_boolean, pa.types.is_null))


def _floats(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric column as float64, NaN where it is empty."""
    return np.asarray(column.cast(pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)


def _label_floats(column: pa.ChunkedArray, name: str, where: RowNamer) -> np.ndarray:
    """The labels as float64 (NaN where empty); an error naming the first non-numeric one."""
    kind = column.type
    if not any(check(kind) for check in (pa.types.is_boolean, pa.types.is_temporal)):
        try:
            return _floats(column)  # numbers, or text of numbers
        except (pa.ArrowException, ValueError):
            pass
    values = column.to_pylist()
    first = next((i for i, value in enumerate(values) if not _is_number(value)), 0)
    raise DataError(
        f"{where(first)}: label {values[first]!r} is not an integer (column {name!r} holds {kind})"
    )


def _is_number(value: object) -> bool:
    """Whether a label cell is empty or a number (or its text); a boolean is not."""
    if value is None:
        return True
    if isinstance(value, bool):
        return False
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def _check_labels(labels: np.ndarray, keep: np.ndarray, where: RowNamer, classes: int) -> None:
    """Every kept label an integer in [0, num_classes); else an error naming the first row."""
    fractional = np.flatnonzero(keep & (labels != np.floor(labels)))
    if len(fractional):
        row = fractional[0]
        raise DataError(f"{where(row)}: label {labels[row]:g} is not an integer")
    outside = np.flatnonzero(keep & ((labels < 0) | (labels >= classes)))
    if len(outside):
        row = outside[0]
        raise DataError(
            f"{where(row)}: label {labels[row]:g} is outside [0, {classes}) (model.num_classes)"
        )


def _row_namer(path: Path, fmt: str) -> RowNamer:
    """`path:ROW` of a 0-based table row: a Parquet file's row from 1, a CSV file's line (the
    header line 1, blank lines, which hold no row, counted)."""
    if fmt != "csv":
        return lambda row: f"{path}:{row + 1}"
    lines: list[int] = []

    def where(row: int) -> str:
        if not lines:
            content = path.read_bytes().split(b"\n")
            lines.extend(n for n, line in enumerate(content, 1) if line not in (b"", b"\r"))
        return f"{path}:{lines[row + 1] if row + 1 < len(lines) else row + 2}"

    return where
