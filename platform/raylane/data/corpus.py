"""The documents of `data.source: files`: text files (one document each) and JSONL rows
(`text`, `prompt` + `completion`, or chat `messages`), each as pieces that say which text the
model learns.

A bad file or row is named as `path: reason` or `path:LINE: reason`; under
`data.on_bad_rows: skip` it is left out and counted instead of stopping the preparation.
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raylane.config import DataConfig
from raylane.config.data import TABLE_SUFFIXES
from raylane.data.chat import BadRow, Piece, json_type
from raylane.data.errors import DataError

#: Suffixes `data.format: auto` reads as text (one document per file), and as JSON lines.
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
JSONL_SUFFIXES = (".jsonl",)
#: What `data.format: auto` reads each suffix as, for messages.
AUTO_FORMATS = (
    f"data.format 'auto' reads {', '.join(TEXT_SUFFIXES)} as text, {', '.join(JSONL_SUFFIXES)} "
    f"as JSON lines and {', '.join(TABLE_SUFFIXES)} as tables"
)

log = logging.getLogger("raylane")


@dataclass(frozen=True)
class Document:
    """One document: where it came from (`path` or `path:LINE`) and its pieces, each a text and
    whether the model learns it (plain text: all of it; chat: the assistants' contents). A plain
    `(text, learnt)` pair is taken as a `Piece` of the data's own text."""

    origin: str
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pieces", tuple(Piece(*piece) for piece in self.pieces))

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)

    @property
    def ends_learnt(self) -> bool:
        """Whether the end-of-text token after it is learnt: when its last piece is."""
        return self.pieces[-1].learnt


@dataclass
class Corpus:
    files: list[Path]
    documents: list[Document] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # `path[:LINE]: reason` of each bad row


def resolve_files(patterns: list[str]) -> list[Path]:
    """The files `patterns` (paths or globs, relative to the working directory) name, each
    pattern's matches sorted, in pattern order, each file once."""
    files: dict[Path, None] = {}
    for pattern in patterns:
        matches = [Path(p) for p in sorted(glob.glob(pattern, recursive=True))]
        matches = [p for p in matches if p.is_file()]
        if not matches:
            raise DataError(f"data.files: {pattern!r} matches no file")
        files.update(dict.fromkeys(matches))
    return list(files)


def file_format(path: Path, configured: str) -> str:
    """'text', 'jsonl', 'csv' or 'parquet': `data.format`, or under 'auto' the file's suffix."""
    if configured != "auto":
        return configured
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in TABLE_SUFFIXES:
        return TABLE_SUFFIXES[suffix]
    raise DataError(f"{path}: {AUTO_FORMATS}, not {suffix or 'no suffix'}; set data.format")


def warn_skipped(skipped: list[str], count: int | None = None) -> None:
    """The warning that bad rows were left out: how many (`count`, else all of `skipped`), and
    the first one's reason."""
    if skipped:
        count = len(skipped) if count is None else count
        log.warning(
            "data.files: skipped %d bad row%s (data.on_bad_rows: skip); the first: %s",
            count,
            "" if count == 1 else "s",
            skipped[0],
        )


def read_corpus(files: list[Path], data: DataConfig, chat: Callable[[Any], tuple]) -> Corpus:
    """Every document of `files`; `chat` turns a row's `messages` into pieces. A bad row stops
    with its `DataError` or, under `on_bad_rows: skip`, is counted in `skipped`."""
    corpus = Corpus(files=files)
    for path in files:
        if file_format(path, data.format) == "text":
            items: Iterator[Document | str] = iter([text_document(path)])
        else:
            items = jsonl_documents(path, data.text_field, chat)
        for item in items:
            if isinstance(item, Document):
                corpus.documents.append(item)
            elif data.on_bad_rows == "skip":
                corpus.skipped.append(item)
            else:
                raise DataError(item)
    if not corpus.documents:
        raise DataError(f"data.files: no documents ({len(corpus.skipped)} bad rows skipped)")
    return corpus


def text_document(path: Path) -> Document | str:
    """A text file as one document, or the reason it cannot be one."""
    return text_bytes_document(str(path), path.read_bytes())


def text_bytes_document(origin: str, raw: bytes) -> Document | str:
    """A text file's bytes as one document, or the reason they cannot be one (a UTF-8
    byte-order mark, which some editors write, is not text)."""
    raw = raw.removeprefix(codecs.BOM_UTF8)
    if not raw.strip():
        return f"{origin}: empty file"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"{origin}: not UTF-8 at byte {exc.start}"
    return Document(origin, (Piece(text, True),))


def jsonl_documents(
    path: Path, text_field: str, chat: Callable[[Any], tuple]
) -> Iterator[Document | str]:
    """Each non-blank line of a JSONL file as a document, or the reason it cannot be one; a
    leading byte-order mark is skipped (byte offsets in messages still count it)."""
    raw = path.read_bytes()
    if not raw.removeprefix(codecs.BOM_UTF8).strip():
        yield f"{path}: empty file"
        return
    for _, item in jsonl_lines(str(path), raw, text_field, chat):
        yield item


def jsonl_lines(
    path: str,
    raw: bytes,
    text_field: str,
    chat: Callable[[Any], tuple],
    first_line: int = 1,
    first_byte: int = 0,
) -> Iterator[tuple[int, Document | str]]:
    """`(LINE, document or reason)` of each non-blank line of `raw`: a JSONL file's bytes, or
    the whole lines of it that start at byte `first_byte`, line `first_line` (messages name
    the file's own lines and byte offsets)."""
    if first_byte == 0 and raw.startswith(codecs.BOM_UTF8):
        raw = b" " * len(codecs.BOM_UTF8) + raw[len(codecs.BOM_UTF8) :]
    offset = first_byte
    for number, line in enumerate(raw.split(b"\n"), start=first_line):
        start, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            yield number, f"{where}: not UTF-8 at byte {start + exc.start}"
            continue
        except json.JSONDecodeError as exc:
            yield number, f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
            continue
        try:
            yield number, Document(where, row_pieces(row, text_field, chat))
        except BadRow as exc:
            yield number, f"{where}: {exc}"


def row_pieces(row: Any, text_field: str, chat: Callable[[Any], tuple]) -> tuple[Piece, ...]:
    """A JSONL row's pieces: all of `text_field`'s text learnt; a prompt read and its
    completion learnt; a chat rendered, its assistants' contents learnt."""
    if not isinstance(row, dict):
        raise BadRow(f"expected a JSON object, found {json_type(row)}")
    if text_field in row:
        return (Piece(_string(row, text_field), True),)
    if "prompt" in row and "completion" in row:
        prompt = _string(row, "prompt", empty=True)
        pieces = (Piece(prompt, False), Piece(_string(row, "completion"), True))
        return pieces if prompt else pieces[1:]
    if "messages" in row:
        return chat(row["messages"])
    raise BadRow(
        f"expected {text_field!r}, 'prompt'+'completion' or 'messages', found keys {sorted(row)}"
    )


def _string(row: dict, key: str, empty: bool = False) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise BadRow(f"{key!r} must be a string, found {json_type(value)}")
    if not value and not empty:
        raise BadRow(f"{key!r} is empty")
    return value
