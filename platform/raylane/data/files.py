"""`data.source: files`: the user's text and JSONL files prepared as token windows in Parquet
(CSV and Parquet tables as feature rows: `raylane.data.tabular`).

The splits are written with a manifest.json beside the training split (every source file with
its sha256 and size, the tokenizer, the counts) and, for a BPE or a given tokenizer.json, the
tokenizer itself as tokenizer.json. The manifest also keeps a fingerprint of what the splits
were built from: the data fields, model.input_dim and the bytes of every source and tokenizer
file. Preparing again when the fingerprint is the same does nothing; any change re-prepares.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from raylane.config import RaylaneConfig
from raylane.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from raylane.data.corpus import file_format, read_corpus, resolve_files, warn_skipped
from raylane.data.errors import DataError
from raylane.data.packing import Packed, pack, split_documents
from raylane.data.prepare import write_split
from raylane.data.tabular import is_table, prepare_table
from raylane.data.text import MANIFEST
from raylane.data.tokenizer import (
    BYTES,
    END_OF_TEXT,
    Tokenizer,
    check_vocabulary,
    load_tokenizer,
    train_bpe,
)

#: The tokenizer beside the splits (none for bytes).
TOKENIZER_FILE = "tokenizer.json"
#: Bumped when the same inputs would be prepared differently: the fingerprint changes with it.
PREPARATION_VERSION = 2
#: Data fields that do not change the prepared rows (the unit size only when streamed: then
#: the fingerprint records it apart).
_UNUSED_FIELDS = {"cache", "feed", "max_bytes", "stream_above_mib", "stream_unit_mib"}
_PATH_FIELDS = {"files", "train_path", "validation_path"}


@dataclass(frozen=True)
class Sources:
    """What a preparation reads: the files, each `{path, sha256, bytes}`, and the fingerprint."""

    files: list[Path]
    entries: list[dict]
    fingerprint: str
    streaming: bool = False  # prepared by Ray Data (`raylane.data.streaming`), see `streams`


def file_entry(path: Path) -> dict:
    """`{path, sha256, bytes}` of a file."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return {"path": str(path), "sha256": digest.hexdigest(), "bytes": Path(path).stat().st_size}


def given_tokenizer_path(cfg: RaylaneConfig) -> Path | None:
    """The tokenizer.json `data.tokenizer` names, None for 'bytes' or a BPE to train."""
    spec = cfg.data.tokenizer
    return Path(spec) if isinstance(spec, str) and spec != "bytes" else None


def streams(cfg: RaylaneConfig, files: list[Path], entries: list[dict]) -> bool:
    """Whether text and JSONL files are prepared by Ray Data, streamed, instead of in the
    driver's memory: under `data.feed: ray_data`, or `auto` with more than
    `data.stream_above_mib` of sources. Tables are always prepared in memory."""
    data = cfg.data
    if data.feed == "memory" or is_table(files, data.format):
        return False
    large = sum(entry["bytes"] for entry in entries) > data.stream_above_bytes
    return data.feed == "ray_data" or large


def find_sources(cfg: RaylaneConfig) -> Sources:
    """The files `data.files` names (an error for a glob that matches none) and the
    fingerprint of everything the prepared splits depend on."""
    files = resolve_files(cfg.data.files)
    entries = [file_entry(path) for path in files]
    tokenizer = given_tokenizer_path(cfg)
    beside = () if tokenizer is None else (tokenizer, tokenizer.parent / "tokenizer_config.json")
    # What the splits are made of, not where things are named from: file contents (in order),
    # never path strings, so a relative and an absolute spelling of one file agree (a Tune
    # trial's config is absolute, `raylane train`'s as written).
    settings = cfg.data.model_dump(mode="json", exclude=_UNUSED_FIELDS | _PATH_FIELDS)
    if tokenizer is not None:
        settings["tokenizer"] = "tokenizer.json"  # its bytes are in tokenizer_files
    record = {
        "version": PREPARATION_VERSION,
        "data": settings,
        "context_length": cfg.model.input_dim,
        "files": [_content(entry) for entry in entries],
        "tokenizer_files": [_content(file_entry(path)) for path in beside if path.is_file()],
    }
    streaming = streams(cfg, files, entries)
    if streaming:  # another split rule and packing (absent: earlier manifests still match)
        record["streaming"] = True
        record["unit_bytes"] = cfg.data.stream_unit_bytes  # where each unit's tail is dropped
    fingerprint = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    return Sources(files, entries, fingerprint, streaming)


def _content(entry: dict) -> dict:
    return {key: value for key, value in entry.items() if key != "path"}


def stale_sources(cfg: RaylaneConfig) -> Sources | None:
    """The sources when the splits must be (re)prepared: missing, or built from anything else
    (a manifest with another fingerprint); None when they are up to date."""
    sources = find_sources(cfg)
    data = cfg.data
    manifest = Path(data.train_path).parent / MANIFEST
    if Path(data.train_path).exists() and Path(data.validation_path).exists():
        try:
            recorded = json.loads(manifest.read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded == sources.fingerprint:
            return None
    return sources


def prepare_files(cfg: RaylaneConfig, sources: Sources | None = None) -> tuple[int, int]:
    """Read, split, tokenize and pack the files; write both splits, the tokenizer and the
    manifest. Returns the windows of each split (tables: the rows, see `prepare_table`)."""
    data, context = cfg.data, cfg.model.input_dim
    sources = sources or find_sources(cfg)
    if is_table(sources.files, data.format):
        write_tokenizer(Path(data.train_path).parent / TOKENIZER_FILE, BYTES)  # none left
        return prepare_table(cfg, sources)
    given_path = given_tokenizer_path(cfg)
    given = None if given_path is None else load_tokenizer(given_path)
    if given is not None:
        check_vocabulary(given, cfg.model.num_classes)
    template, template_origin = chat_template_for(cfg, given)
    corpus = read_corpus(sources.files, data, template.pieces)
    train_docs, validation_docs = split_documents(
        corpus.documents, data.validation_fraction, data.split_seed
    )
    tokenizer = given or tokenizer_for(cfg, [document.text for document in train_docs])
    check_vocabulary(tokenizer, cfg.model.num_classes)
    splits = {
        "train": pack(train_docs, tokenizer, context),
        "validation": pack(validation_docs, tokenizer, context),
    }
    for name, packed in splits.items():
        check_windows(cfg, name, len(packed.inputs), packed.tokens)
    manifest_path = Path(data.train_path).parent / MANIFEST
    manifest_path.unlink(missing_ok=True)  # no fingerprint vouches for half-written splits
    for name, path in (("train", data.train_path), ("validation", data.validation_path)):
        write_split(path, splits[name].inputs, splits[name].labels, data)
    write_tokenizer(Path(data.train_path).parent / TOKENIZER_FILE, tokenizer)
    first = corpus.skipped[0] if corpus.skipped else None
    counts = packed_counts(splits)
    manifest = manifest_record(cfg, sources, tokenizer, counts, (len(corpus.skipped), first))
    manifest["chat_template"] = template_origin
    manifest["documents"] = {"train": len(train_docs), "validation": len(validation_docs)}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    warn_skipped(corpus.skipped)
    return len(splits["train"].inputs), len(splits["validation"].inputs)


def chat_template_for(cfg: RaylaneConfig, given: Tokenizer | None) -> tuple[ChatTemplate, dict]:
    """The template chat rows are rendered with, and where it came from (for the manifest):
    data.chat_template, else a given tokenizer's tokenizer_config.json, else raylane's."""
    configured = cfg.data.chat_template
    if configured is not None:
        source, origin = configured, "data.chat_template"
    elif given is not None and given.chat_template is not None:
        source, origin = given.chat_template, "tokenizer_config.json"
    else:
        source, origin = DEFAULT_CHAT_TEMPLATE, "default"
    if given is not None:
        eos, bos = given.eot_token, given.bos_token
    else:
        eos, bos = (BYTES.eot_token if cfg.data.tokenizer == "bytes" else END_OF_TEXT), ""
    digest = hashlib.sha256(source.encode()).hexdigest()
    return ChatTemplate(source, bos_token=bos, eos_token=eos), {"from": origin, "sha256": digest}


def tokenizer_for(cfg: RaylaneConfig, train_texts: list[str]) -> Tokenizer:
    """Bytes, or a BPE trained on the training split's documents."""
    spec = cfg.data.tokenizer
    return BYTES if spec == "bytes" else train_bpe(train_texts, spec.train.vocab_size)


def check_windows(cfg: RaylaneConfig, name: str, windows: int, tokens: int) -> None:
    """A split without a single window is an error naming its tokens."""
    if windows:
        return
    hint = " or raise data.validation_fraction" if name == "validation" else ""
    raise DataError(
        f"data.files: the {name} split's {tokens} tokens make no window of "
        f"model.input_dim {cfg.model.input_dim} (+1) with a learnt label; add documents{hint}"
    )


def write_tokenizer(path: Path, tokenizer: Tokenizer) -> None:
    """The tokenizer beside the splits; for bytes none (and none left from an earlier one)."""
    content = tokenizer.file_bytes()
    if content is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(content)
    tmp.replace(path)


def manifest_record(
    cfg: RaylaneConfig,
    sources: Sources,
    tokenizer: Tokenizer,
    counts: dict[str, dict[str, int]],
    skipped: tuple[int, str | None],
) -> dict:
    """The manifest: the sources, the tokenizer, `counts` (each a figure per split: tokens,
    windows, ...) and the bad rows skipped (how many, the first one's reason)."""
    files = [
        {**entry, "format": file_format(path, cfg.data.format)}
        for path, entry in zip(sources.files, sources.entries, strict=True)
    ]
    described = tokenizer.describe()
    if tokenizer.kind != "bytes":
        described["saved_as"] = TOKENIZER_FILE
    return {
        "source": "files",
        "fingerprint": sources.fingerprint,
        "files": files,
        "tokenizer": described,
        "context_length": cfg.model.input_dim,
        **counts,
        "skipped_rows": skipped[0],
        "first_skipped": skipped[1],
    }


def packed_counts(splits: dict[str, Packed]) -> dict[str, dict[str, int]]:
    """The manifest's figures of packed splits."""
    return {
        "tokens": {name: packed.tokens for name, packed in splits.items()},
        "windows": {name: len(packed.inputs) for name, packed in splits.items()},
        "masked_tokens": {name: packed.masked for name, packed in splits.items()},
        "unlearnt_windows": {name: packed.unlearnt_windows for name, packed in splits.items()},
    }
