"""The pieces of a streamed preparation that need no Ray: source files cut into units of work,
each document's stable key and split, and one unit read, tokenized and packed.

A unit is a list of byte ranges: a whole text file (one document), or whole lines of a JSONL
file with the number of its first line, so each row is still named `path:LINE`. A document's
split comes from its key alone (the file's sha256 and, for JSONL, its line), hashed with
`data.split_seed`: the same document lands in the same split whichever unit, batch or worker
reads it, so no window can hold tokens of both splits. A file's content, not its path, keys it:
a relative and an absolute spelling of one file agree, and duplicate files share their split.

Each unit is packed on its own: its documents of a split, joined with the end-of-text token,
cut into windows as `raylane.data.packing.pack` cuts a whole split. The tokens after the unit's
last full window are dropped (counted as `dropped_tokens`), never carried into the next unit:
every unit's windows are then exactly `pack` of its documents, whatever order units finish in.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from raylane.config import DataConfig
from raylane.data.corpus import Document, file_format, jsonl_lines, text_bytes_document
from raylane.data.errors import DataError
from raylane.data.packing import Packed, pack
from raylane.data.tokenizer import Tokenizer

#: The splits, in the order the manifest lists them.
SPLITS = ("train", "validation")
#: The manifest's per-split figures of a streamed preparation.
COUNTS = ("documents", "tokens", "windows", "masked_tokens", "unlearnt_windows", "dropped_tokens")


@dataclass(frozen=True)
class Span:
    """Bytes `[start, end)` of a file: a whole text file, or whole JSONL lines from `line`."""

    path: str
    sha256: str
    format: str
    start: int
    end: int
    line: int = 1


def plan_units(
    files: list[Path], entries: list[dict], data: DataConfig, unit_bytes: int | None = None
) -> list[list[Span]]:
    """The files as units of about `unit_bytes` each (default `data.stream_unit_mib`), in file
    order: text files whole (a file larger than a unit is a unit of its own), JSONL files cut
    after a newline."""
    unit_bytes = unit_bytes or data.stream_unit_bytes
    units: list[list[Span]] = [[]]
    size = 0
    for path, entry in zip(files, entries, strict=True):
        for span in file_spans(path, entry, data.format, unit_bytes):
            length = span.end - span.start
            if units[-1] and size + length > unit_bytes:
                units.append([])
                size = 0
            units[-1].append(span)
            size += length
    return [unit for unit in units if unit]


def file_spans(path: Path, entry: dict, configured: str, unit_bytes: int) -> Iterator[Span]:
    """A file's spans: the whole of a text file; a JSONL file in pieces of about `unit_bytes`,
    each ending after a newline (or at the file's end), with the number of its first line."""
    kind, size = file_format(path, configured), entry["bytes"]
    if kind != "jsonl" or size <= unit_bytes:
        yield Span(str(path), entry["sha256"], kind, 0, size)
        return
    start, line = 0, 1
    with Path(path).open("rb") as handle:
        while start < size:
            handle.seek(start)
            chunk = handle.read(unit_bytes)
            cut = len(chunk) if start + len(chunk) >= size else chunk.rfind(b"\n") + 1
            while cut == 0:  # a line longer than a unit: read on to its end
                more = handle.read(unit_bytes)
                newline = more.find(b"\n")
                chunk += more
                if not more or newline >= 0:
                    cut = len(chunk) - len(more) + newline + 1 if more else len(chunk)
            yield Span(str(path), entry["sha256"], kind, start, start + cut, line)
            line += chunk.count(b"\n", 0, cut)
            start += cut


def document_key(sha256: str, line: int | None) -> str:
    """A document's stable key: its file's content hash, and its line for a JSONL row."""
    return sha256 if line is None else f"{sha256}:{line}"


def in_validation(key: str, fraction: float, seed: int) -> bool:
    """Whether a document is held out: a uniform draw from its key and the seed below
    `fraction`."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def span_documents(
    span: Span, data: DataConfig, chat: Callable[[Any], tuple]
) -> Iterator[tuple[str, Document | str]]:
    """`(key, document or reason)` of each document of a span, read with the corpus readers."""
    with Path(span.path).open("rb") as handle:
        handle.seek(span.start)
        raw = handle.read(span.end - span.start)
    if span.format == "text":
        yield document_key(span.sha256, None), text_bytes_document(span.path, raw)
        return
    if span.start == 0 and not raw.strip():
        yield document_key(span.sha256, None), f"{span.path}: empty file"
        return
    for line, item in jsonl_lines(span.path, raw, data.text_field, chat, span.line, span.start):
        yield document_key(span.sha256, line), item


def unit_documents(
    unit: list[Span], data: DataConfig, chat: Callable[[Any], tuple]
) -> tuple[dict[str, list[Document]], list[str]]:
    """A unit's documents by split, and the reasons of its bad rows (skipped); a bad row stops
    with its `DataError` unless `data.on_bad_rows` is 'skip'."""
    documents: dict[str, list[Document]] = {name: [] for name in SPLITS}
    skipped: list[str] = []
    for span in unit:
        for key, item in span_documents(span, data, chat):
            if not isinstance(item, Document):
                if data.on_bad_rows != "skip":
                    raise DataError(item)
                skipped.append(item)
                continue
            held_out = in_validation(key, data.validation_fraction, data.split_seed)
            documents[SPLITS[held_out]].append(item)
    return documents, skipped


def pack_unit(
    unit: list[Span],
    data: DataConfig,
    tokenizer: Tokenizer,
    context_length: int,
    chat: Callable[[Any], tuple],
) -> tuple[pa.Table, dict]:
    """A unit's windows of both splits as one table (the configured features and label columns,
    as `write_split` writes them, and `split`) and its figures: per split the `COUNTS`, and
    `skipped` (how many bad rows, the first one's reason)."""
    documents, skipped = unit_documents(unit, data, chat)
    tables, counts = [], {name: {} for name in COUNTS}
    for name in SPLITS:
        packed = pack(documents[name], tokenizer, context_length)
        tables.append(windows_table(packed, data, name, context_length))
        counts["documents"][name] = len(documents[name])
        for field, value in packed_figures(packed, context_length).items():
            counts[field][name] = value
    first = skipped[0] if skipped else None
    return pa.concat_tables(tables), {"counts": counts, "skipped": [len(skipped), first]}


def packed_figures(packed: Packed, context_length: int) -> dict[str, int]:
    """A packed stream's figures; `dropped_tokens`: those after the last full window."""
    cut = len(packed.inputs) + packed.unlearnt_windows
    return {
        "tokens": packed.tokens,
        "windows": len(packed.inputs),
        "masked_tokens": packed.masked,
        "unlearnt_windows": packed.unlearnt_windows,
        "dropped_tokens": packed.tokens - cut * context_length,
    }


def windows_table(packed: Packed, data: DataConfig, split: str, context_length: int) -> pa.Table:
    """Windows as `write_split` writes them (fixed-size int64 lists), with their split."""

    def column(values: np.ndarray) -> pa.Array:
        flat = pa.array(values.reshape(-1).astype(np.int64), type=pa.int64())
        return pa.FixedSizeListArray.from_arrays(flat, context_length)

    return pa.table(
        {
            data.features_column: column(packed.inputs),
            data.label_column: column(packed.labels),
            "split": pa.array([split] * len(packed.inputs), type=pa.string()),
        }
    )


def merge_figures(figures: list[dict]) -> tuple[dict[str, dict[str, int]], list]:
    """Units' figures (in unit order) summed: the counts, and `[bad rows, first reason]`."""
    counts = {field: dict.fromkeys(SPLITS, 0) for field in COUNTS}
    skipped: list = [0, None]
    for figure in figures:
        for field, per_split in figure["counts"].items():
            for name, value in per_split.items():
                counts[field][name] += value
        skipped[0] += figure["skipped"][0]
        skipped[1] = skipped[1] or figure["skipped"][1]
    return counts, skipped


def encode_unit(unit: list[Span]) -> str:
    """A unit as one JSON string (a row Ray Data carries unchanged)."""
    return json.dumps([span.__dict__ for span in unit])


def decode_unit(encoded: str) -> list[Span]:
    return [Span(**span) for span in json.loads(encoded)]
