"""`data.source: files` prepared by Ray Data, for corpora larger than the driver's memory.

The driver plans units of work (`raylane.data.shards`: byte ranges of the files, a few MB
each) and never reads a document: Ray Data's tasks read each unit with the corpus readers,
assign each document to its split by its key, tokenize and pack it (`map_batches`), and write
both splits with `write_parquet`, partitioned by split; the two partitions are then moved to
`data.train_path` and `data.validation_path` (directories of Parquet files). A trained BPE
learns from the training documents streamed through the driver one at a time
(`train_from_iterator`). Each unit's figures go to a small actor, recorded by unit, so a retried
task is not counted twice; the manifest sums them.

Every worker reads the files at the paths the driver names: a multi-node cluster needs them,
and the output directory, on storage all nodes share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa

from raylane.config import RaylaneConfig
from raylane.data.corpus import warn_skipped
from raylane.data.errors import DataError
from raylane.data.files import (
    TOKENIZER_FILE,
    Sources,
    chat_template_for,
    check_windows,
    given_tokenizer_path,
    manifest_record,
    write_tokenizer,
)
from raylane.data.shards import (
    SPLITS,
    decode_unit,
    encode_unit,
    merge_figures,
    pack_unit,
    plan_units,
    unit_documents,
)
from raylane.data.text import MANIFEST
from raylane.data.tokenizer import BYTES, Tokenizer, check_vocabulary, load_tokenizer, train_bpe

#: Decoded bytes of one Parquet row group the streamed preparation writes, and of one window
#: per token (int64 features and labels).
ROW_GROUP_BYTES = 8 << 20
WINDOW_ROW_BYTES = 16


def prepare_streaming(cfg: RaylaneConfig, sources: Sources) -> tuple[int, int]:
    """Prepare text and JSONL files with Ray Data (see the module), in units of
    `data.stream_unit_mib`; returns each split's windows. Uses the connected Ray, else starts a
    local one for the preparation."""
    data = cfg.data
    unit_bytes = data.stream_unit_bytes
    given_path = given_tokenizer_path(cfg)
    given = None if given_path is None else load_tokenizer(given_path)
    if given is not None:
        check_vocabulary(given, cfg.model.num_classes)
    template, template_origin = chat_template_for(cfg, given)
    units = plan_units(sources.files, sources.entries, data, unit_bytes)
    with ray_data_session() as ray:
        rows = ray.data.from_items(
            [{"unit": i, "spans": encode_unit(unit)} for i, unit in enumerate(units)],
            override_num_blocks=len(units),
        )
        figures = ray.remote(num_cpus=0)(_Figures).remote()
        tokenizer = given or _tokenizer(cfg, rows, template.pieces, figures)
        check_vocabulary(tokenizer, cfg.model.num_classes)
        staging = Path(data.train_path).parent / f".staging-{uuid.uuid4().hex[:12]}"
        try:
            done = _write_windows(cfg, rows, tokenizer, template.pieces, figures, staging)
            counts, skipped = merge_figures(done)
            _check(cfg, counts)
            manifest_path = Path(data.train_path).parent / MANIFEST
            manifest_path.unlink(missing_ok=True)  # no fingerprint vouches for half-moved splits
            for name, path in zip(SPLITS, (data.train_path, data.validation_path), strict=True):
                _move_split(staging / f"split={name}", Path(path))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    write_tokenizer(Path(data.train_path).parent / TOKENIZER_FILE, tokenizer)
    manifest = manifest_record(cfg, sources, tokenizer, counts, tuple(skipped))
    manifest["chat_template"] = template_origin
    manifest["prepared_by"] = {
        "engine": "ray_data",
        "units": len(units),
        "unit_bytes": unit_bytes,
        "split": "by document key (file sha256, JSONL line) hashed with data.split_seed",
        "tail": "tokens after each unit's last full window dropped (dropped_tokens)",
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))
    warn_skipped([skipped[1]] if skipped[1] else [], skipped[0])
    return counts["windows"]["train"], counts["windows"]["validation"]


@contextlib.contextmanager
def ray_data_session() -> Iterator[Any]:
    """`ray` with Ray Data, Ray connected (the running one, $RAY_ADDRESS, else a local Ray started
    here and stopped after), results in order, no progress bars."""
    import ray  # lazy: Ray starts only for a streamed preparation
    import ray.data

    started = not ray.is_initialized()
    if started:
        address = os.environ.get("RAY_ADDRESS") or "local"
        ray.init(
            address=address,
            logging_level=logging.WARNING,
            log_to_driver=False,
            include_dashboard=False,
        )
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    context = ray.data.DataContext.get_current()
    saved = (context.execution_options.preserve_order, context.enable_progress_bars)
    # In order: the BPE learns from the documents in corpus order, the same run after run.
    context.execution_options.preserve_order, context.enable_progress_bars = True, False
    try:
        yield ray
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = saved
        if started:
            ray.shutdown()


class _Figures:
    """Each unit's figures, by unit (a retried unit replaces its own), and the bad row that
    stopped a unit: Ray hands the driver a task's error as a traceback, this keeps its line."""

    def __init__(self) -> None:
        self.units: dict[int, dict] = {}
        self.errors: dict[int, str] = {}

    def record(self, unit: int, figures: dict) -> None:
        self.units[unit] = figures

    def fail(self, unit: int, error: str) -> None:
        self.errors[unit] = error

    def first_error(self) -> str | None:
        return self.errors[min(self.errors)] if self.errors else None

    def in_order(self) -> list[dict]:
        return [self.units[unit] for unit in sorted(self.units)]


@contextlib.contextmanager
def _bad_rows_raised(figures: Any) -> Iterator[None]:
    """A unit stopped by a bad row fails the whole run with that row's one-line `DataError`
    (of the first such unit)."""
    import ray  # lazy: Ray starts only for a streamed preparation

    try:
        yield
    except Exception:
        error = ray.get(figures.first_error.remote())
        if error is None:
            raise
        raise DataError(error) from None


def _unit_read(figures: Any, index: int, read: Any) -> Any:
    """`read()` of one unit; a bad row's error recorded (by unit) before it stops the task."""
    import ray  # lazy: runs in a Ray Data task

    try:
        return read()
    except DataError as exc:
        ray.get(figures.fail.remote(index, str(exc)))
        raise


def _tokenizer(cfg: RaylaneConfig, rows: Any, chat: Any, figures: Any) -> Tokenizer:
    """Bytes, or a BPE trained on the training split's documents, streamed in corpus order."""
    spec = cfg.data.tokenizer
    if spec == "bytes":
        return BYTES
    kwargs = {"data": cfg.data, "chat": chat, "figures": figures}
    texts = rows.map_batches(_training_texts, batch_size=1, fn_kwargs=kwargs)
    with _bad_rows_raised(figures):
        return train_bpe((row["text"] for row in texts.iter_rows()), spec.train.vocab_size)


def _training_texts(batch: dict, *, data: Any, chat: Any, figures: Any) -> dict:
    texts: list[str] = []
    for index, encoded in zip(batch["unit"], batch["spans"], strict=True):
        unit = decode_unit(str(encoded))
        documents, _ = _unit_read(figures, int(index), partial(unit_documents, unit, data, chat))
        texts += [document.text for document in documents["train"]]
    return {"text": texts}


def _write_windows(
    cfg: RaylaneConfig, rows: Any, tokenizer: Tokenizer, chat: Any, figures: Any, staging: Path
) -> list[dict]:
    """Pack every unit and write the windows under `staging/split=NAME/`; each unit's
    figures, in unit order."""
    import ray  # lazy: Ray starts only for a streamed preparation

    kwargs = {
        "data": cfg.data,
        "tokenizer": tokenizer,
        "context_length": cfg.model.input_dim,
        "chat": chat,
        "figures": figures,
    }
    packed = rows.map_batches(_pack_units, batch_size=1, fn_kwargs=kwargs)
    # Row groups of about ROW_GROUP_BYTES: a reader (the driver's check, Ray Data's read
    # tasks) holds one decoded row group at a time, not a unit's tens of MB.
    group_rows = max(1, ROW_GROUP_BYTES // (cfg.model.input_dim * WINDOW_ROW_BYTES))
    with _bad_rows_raised(figures):
        packed.write_parquet(str(staging), partition_cols=["split"], row_group_size=group_rows)
    return ray.get(figures.in_order.remote())


def _pack_units(batch: dict, *, figures: Any, **settings: Any) -> pa.Table:
    import ray  # lazy: runs in a Ray Data task

    tables = []
    for index, encoded in zip(batch["unit"], batch["spans"], strict=True):
        unit = decode_unit(str(encoded))
        table, unit_figures = _unit_read(figures, int(index), partial(pack_unit, unit, **settings))
        ray.get(figures.record.remote(int(index), unit_figures))
        tables.append(table)
    return pa.concat_tables(tables)


def _check(cfg: RaylaneConfig, counts: dict[str, dict[str, int]]) -> None:
    if not sum(counts["documents"].values()):
        raise DataError("data.files: no documents (every row was bad and skipped)")
    for name in SPLITS:
        check_windows(cfg, name, counts["windows"][name], counts["tokens"][name])


def _move_split(written: Path, target: Path) -> None:
    """`written` (a directory of Parquet files) becomes `target`, replacing an earlier split
    (a file, or a directory of nothing but Parquet files)."""
    if target.is_file():
        target.unlink()
    elif target.is_dir():
        for file in target.rglob("*.parquet"):
            file.unlink()
        for directory in sorted(target.rglob("*"), reverse=True):
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        if any(target.iterdir()):
            raise DataError(f"{target}: holds files other than Parquet; move them or the split")
        target.rmdir()
    target.parent.mkdir(parents=True, exist_ok=True)
    written.rename(target)
