"""`data:`: where the rows come from, how text is tokenized and packed, and how workers read
them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from raylane.config.strict import StrictModel

#: The formats of source 'files' that are tables, and the suffixes 'auto' reads as each.
TABLE_SUFFIXES = {".csv": "csv", ".parquet": "parquet"}
TABLE_FORMATS = tuple(TABLE_SUFFIXES.values())


class BpeTraining(StrictModel):
    vocab_size: int = Field(
        ...,
        ge=257,
        le=1 << 20,
        description="Most tokens of the trained BPE: the 256 bytes, the end-of-text token and "
        "the merges learnt.",
    )


class TokenizerTraining(StrictModel):
    train: BpeTraining = Field(
        ..., description="A byte-level BPE trained on the training split's documents."
    )


class DataConfig(StrictModel):
    source: Literal[
        "sklearn-digits", "python-stdlib", "python-stdlib-tests", "files", "parquet"
    ] = Field(
        "sklearn-digits",
        description="Where the data comes from. 'sklearn-digits' (8x8 digit images), "
        "'python-stdlib' (byte windows of the Python standard library's top-level modules, for "
        "language models) and 'python-stdlib-tests' (its test suite, `test/test_*.py`: text "
        "no 'python-stdlib' run has seen, for fine-tuning) are materialised to Parquet by "
        "`raylane prepare` (or on first use); 'files' prepares your text and JSONL files "
        "(`files`) the same way, as token windows, or your CSV and Parquet tables as feature "
        "rows (again whenever they or the data fields change); 'parquet' reads existing files "
        "you provide, each row's features in one list column.",
    )
    files: list[str] = Field(
        default_factory=list,
        description="source 'files': the files to read, as paths or globs (`**` too) relative "
        "to the working directory, each of which must match a file; read in this order, each "
        "glob's matches sorted.",
    )
    format: Literal["auto", "text", "jsonl", "csv", "parquet"] = Field(
        "auto",
        description="source 'files': 'text' (each file one document), 'jsonl' (a JSON object "
        "a line: `text`, `prompt` + `completion`, or chat `messages`, a list of `{role, "
        "content}` with role system, user or assistant), 'csv' or 'parquet' (a table: one "
        "numeric column per feature and `label_column`'s integer class, for an mlp or cnn; "
        "`model.input_dim` is the number of feature columns), or 'auto': by suffix, .txt .md "
        ".py .rst text, .jsonl JSON lines, .csv and .parquet tables.",
    )
    feature_columns: list[str] | None = Field(
        None,
        description="source 'files', tables: the feature columns, in this order. None: every "
        "column but `label_column`, in the first file's order.",
    )
    text_field: str = Field(
        "text", min_length=1, description="source 'files', JSONL: the key of a row's plain text."
    )
    tokenizer: str | TokenizerTraining = Field(
        "bytes",
        description="source 'files': 'bytes' (the 256 byte values, byte 3, ASCII end-of-text, "
        "after each document), a path to a Hugging Face tokenizer.json (its end-of-text token "
        "from a tokenizer_config.json beside it, else a usual name), or `{train: {vocab_size: "
        "N}}`: a byte-level BPE with an `<|endoftext|>` token, trained deterministically on the "
        "training split's documents. A BPE or given tokenizer is saved as tokenizer.json beside "
        "the training split. model.num_classes must be at least its vocabulary.",
    )
    chat_template: str | None = Field(
        None,
        description="source 'files': the Jinja template that renders a JSONL row's `messages` "
        "(with `messages`, `bos_token`, `eos_token`; contents verbatim). None: the "
        "chat_template of a tokenizer_config.json beside data.tokenizer's tokenizer.json, else "
        "raylane's: each message as `<|ROLE|>`, a newline and its content, messages separated "
        "by a newline. The model learns the assistants' contents only (and a prompt's "
        "completion): every other token's label is -100, which the loss skips.",
    )
    on_bad_rows: Literal["error", "skip"] = Field(
        "error",
        description="source 'files': a bad JSONL row, a table row with an empty, NaN or "
        "infinite value (its LINE: a CSV file's line, the header line 1; a Parquet file's row, "
        "from 1) or an unreadable file either stops the preparation with `path:LINE: reason` "
        "('error'), or is left out ('skip'), counted in manifest.json's `skipped_rows` and in a "
        "warning with the first one's reason.",
    )
    train_path: Path = Field(
        Path("data/digits/train.parquet"),
        description="Parquet file or directory with the training rows (relative to the "
        "working directory).",
    )
    validation_path: Path = Field(
        Path("data/digits/validation.parquet"),
        description="Parquet file or directory with the validation rows.",
    )
    features_column: str = Field(
        "features", description="Column holding each row's features as a list of numbers."
    )
    label_column: str = Field("label", description="Column holding the integer class label.")
    validation_fraction: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="Share of rows held out for validation when preparing a built-in dataset "
        "(source 'files': of documents or table rows, at least one in each split).",
    )
    split_seed: int = Field(
        0, description="Seed of the deterministic train/validation split of a built-in dataset."
    )
    max_bytes: int = Field(
        1 << 19,
        ge=1024,
        description="python-stdlib: how many bytes of source text to take (whole files, in "
        "sorted path order).",
    )
    cache: bool = Field(
        True,
        description="Materialise both splits in Ray's object store once, instead of re-reading "
        "Parquet every epoch. Turn off for datasets larger than the object store.",
    )
    feed: Literal["auto", "memory", "ray_data"] = Field(
        "auto",
        description="How workers read the splits, and how source 'files' text and JSONL are "
        "prepared. 'memory': the driver puts each split in Ray's object store as two arrays "
        "and every worker takes its rows of each global batch (no Ray Data actors to start: "
        "seconds less per job). 'ray_data': Ray Data streams them (sharded across "
        "data-parallel workers), for data of any size. 'auto': memory when cache is on and the "
        "two splits together are at most 64 MB on disk. Source 'files' text and JSONL are "
        "prepared by Ray Data, streamed, never all in the driver's memory, under 'ray_data', "
        "or 'auto' with more than `stream_above_mib` of source files: each document goes to a "
        "split by a seeded hash of its file's sha256 (and JSONL line), and the files are "
        "packed in units of `stream_unit_mib`, the tokens after each unit's last window "
        "dropped (manifest "
        "`dropped_tokens`); the splits are then directories of Parquet files. Otherwise "
        "(and always for tables) the driver reads, splits and packs them in memory.",
    )
    stream_above_mib: float = Field(
        256.0,
        gt=0,
        description="feed 'auto', source 'files' text and JSONL: more than this many MiB of "
        "source files in all are prepared by Ray Data, streamed (see `feed`); this many or "
        "fewer, by the driver in memory. Lower it when the driver's memory is smaller than a "
        "few times the corpus (the in-memory preparation peaks at about 35x the text).",
    )
    stream_unit_mib: float = Field(
        4.0,
        gt=0,
        le=1024,
        description="Streamed preparation: the MiB of source files in one unit of work (a "
        "whole text file, or whole JSONL lines, however large one is). A task holds a unit's "
        "text, tokens and windows at once, so its memory grows with this; smaller units make "
        "more tasks, each with a start-up cost, and drop more tokens (those after each unit's "
        "last window). Part of what the prepared splits depend on.",
    )

    @property
    def stream_above_bytes(self) -> int:
        """`stream_above_mib` in bytes."""
        return int(self.stream_above_mib * 2**20)

    @property
    def stream_unit_bytes(self) -> int:
        """`stream_unit_mib` in bytes (at least 1)."""
        return max(1, int(self.stream_unit_mib * 2**20))

    @property
    def tabular(self) -> bool:
        """Whether source 'files' reads tables: format 'csv' or 'parquet', or 'auto' with
        every `files` pattern ending .csv or .parquet."""
        if self.format in TABLE_FORMATS:
            return True
        suffixes = {Path(pattern).suffix.lower() for pattern in self.files}
        return self.format == "auto" and bool(suffixes) and suffixes <= set(TABLE_SUFFIXES)

    @model_validator(mode="after")
    def _memory_feed_is_cached(self) -> DataConfig:
        if self.feed == "memory" and not self.cache:
            raise ValueError(
                "data.feed 'memory' holds the splits in the object store, which data.cache: "
                "false turns off; set cache: true or feed: ray_data"
            )
        return self

    @model_validator(mode="after")
    def _check_files(self) -> DataConfig:
        tokenizer = self.tokenizer
        if isinstance(tokenizer, str) and tokenizer != "bytes" and not tokenizer.endswith(".json"):
            raise ValueError(
                f"data.tokenizer {tokenizer!r}: expected 'bytes', a path to a tokenizer.json, or "
                "{train: {vocab_size: N}}"
            )
        columns = self.feature_columns
        if columns is not None and (
            not columns or len(set(columns)) < len(columns) or self.label_column in columns
        ):
            raise ValueError(
                f"data.feature_columns {columns}: expected distinct columns, at least one, "
                f"without the label column {self.label_column!r}"
            )
        if self.source == "files" and not self.files:
            raise ValueError("data.source 'files' needs data.files (paths or globs)")
        if self.source != "files" and (self.files or tokenizer != "bytes"):
            raise ValueError(
                f"data.files and data.tokenizer are read with data.source 'files', not "
                f"'{self.source}'"
            )
        return self
