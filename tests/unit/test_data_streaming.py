"""The streamed preparation's Ray-free parts: units of work, document keys and splits, one unit
packed as the in-memory preparation packs, the figures summed, and the rule that chooses it."""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pyarrow as pa
import pytest

from raylane.config import DataConfig
from raylane.config.loader import ConfigError
from raylane.data import DataError
from raylane.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from raylane.data.corpus import Document, jsonl_documents, read_corpus
from raylane.data.files import file_entry, find_sources, streams
from raylane.data.packing import pack, token_stream
from raylane.data.shards import (
    SPLITS,
    Span,
    decode_unit,
    document_key,
    encode_unit,
    file_spans,
    in_validation,
    merge_figures,
    pack_unit,
    plan_units,
    span_documents,
    unit_documents,
)
from raylane.data.streaming import _Figures, _move_split
from raylane.data.tokenizer import BYTES, train_bpe
from tests.unit.test_user_data import _cfg, _corpus

CHAT = ChatTemplate(DEFAULT_CHAT_TEMPLATE, eos_token=BYTES.eot_token).pieces


def _sources(cfg):
    sources = find_sources(cfg)
    return sources.files, sources.entries


def _keyed(cfg, files, entries) -> list[tuple[str, Document]]:
    """Every document of the in-memory reader with the key the streamed one gives it."""
    sha = {str(path): entry["sha256"] for path, entry in zip(files, entries, strict=True)}
    keyed = []
    for document in read_corpus(files, cfg.data, CHAT).documents:
        path, _, line = document.origin.rpartition(":")
        if path in sha and line.isdigit():
            keyed.append((document_key(sha[path], int(line)), document))
        else:
            keyed.append((document_key(sha[document.origin], None), document))
    return keyed


def test_split_by_key_is_seeded_stable_and_near_the_fraction():
    keys = [document_key("ab" * 32, line) for line in range(4000)]
    held = [in_validation(key, 0.2, 7) for key in keys]
    assert held == [in_validation(key, 0.2, 7) for key in keys]
    assert abs(sum(held) / len(keys) - 0.2) < 0.03  # binomial sd 0.006
    assert held != [in_validation(key, 0.2, 8) for key in keys]
    assert document_key("ff", None) == "ff" and document_key("ff", 3) == "ff:3"


def test_jsonl_cut_after_newlines_reads_the_same_rows_and_lines(tmp_path):
    rows = [{"text": f"row {i} " + "x" * (i % 37)} for i in range(400)]
    lines = [json.dumps(row) for row in rows]
    lines[250] = "{bad json"
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    spans = list(file_spans(path, file_entry(path), "auto", 1024))
    assert len(spans) > 10
    assert spans[0].start == 0 and spans[-1].end == path.stat().st_size
    assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))
    raw = path.read_bytes()
    assert all(raw[s.end - 1 : s.end] == b"\n" for s in spans)
    assert [s.line for s in spans] == [raw[: s.start].count(b"\n") + 1 for s in spans]
    streamed = []
    for span in spans:
        streamed += list(unit_documents_items(span))
    whole = list(jsonl_documents(path, "text", CHAT))
    assert streamed == whole
    assert f"{path}:251: not valid JSON" in [i for i in whole if isinstance(i, str)][0]


def unit_documents_items(span: Span):

    data = DataConfig(source="files", files=["x"])
    return (item for _, item in span_documents(span, data, CHAT))


def test_a_bad_row_stops_with_its_line_or_is_counted(tmp_path):
    _corpus(tmp_path)
    with (tmp_path / "corpus" / "rows.jsonl").open("a") as handle:
        handle.write('{"text": 5}\n')
    cfg = _cfg(tmp_path)
    files, entries = _sources(cfg)
    unit = plan_units(files, entries, cfg.data)[0]
    with pytest.raises(DataError, match=r"rows\.jsonl:37: 'text' must be a string, found number"):
        unit_documents(unit, cfg.data, CHAT)
    skip = _cfg(tmp_path, "data.on_bad_rows=skip")
    _, skipped = unit_documents(unit, skip.data, CHAT)
    assert len(skipped) == 1 and skipped[0].endswith(":37: 'text' must be a string, found number")


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_one_unit_packs_as_the_in_memory_preparation(tmp_path, tokenizer):
    _corpus(tmp_path)
    cfg = _cfg(tmp_path, "data.validation_fraction=0.3")
    files, entries = _sources(cfg)
    keyed = _keyed(cfg, files, entries)
    by_split = {name: [] for name in SPLITS}
    for key, document in keyed:
        by_split[SPLITS[in_validation(key, 0.3, cfg.data.split_seed)]].append(document)
    assert min(len(docs) for docs in by_split.values()) >= 3
    tok = BYTES if tokenizer == "bytes" else train_bpe([d.text for d in by_split["train"]], 400)
    units = plan_units(files, entries, cfg.data)
    assert len(units) == 1
    table, figures = pack_unit(units[0], cfg.data, tok, 32, CHAT)
    for name in SPLITS:
        expected = pack(by_split[name], tok, 32)
        part = table.filter(pa.compute.equal(table["split"], name))
        inputs = np.stack(part["features"].to_numpy(zero_copy_only=False))
        labels = np.stack(part["label"].to_numpy(zero_copy_only=False))
        assert np.array_equal(inputs, expected.inputs) and np.array_equal(labels, expected.labels)
        assert figures["counts"]["tokens"][name] == expected.tokens
        assert figures["counts"]["documents"][name] == len(by_split[name])
        cut = (len(expected.inputs) + expected.unlearnt_windows) * 32
        assert figures["counts"]["dropped_tokens"][name] == expected.tokens - cut
    assert part.schema.field("label").type == pa.list_(pa.int64(), 32)


def test_many_units_hold_each_document_whole_and_in_order(tmp_path):
    _corpus(tmp_path, rows=300)
    cfg = _cfg(tmp_path, f"data.stream_unit_mib={4096 / 2**20}")  # 4 KiB units
    files, entries = _sources(cfg)
    units = plan_units(files, entries, cfg.data)
    assert len(plan_units(files, entries, _cfg(tmp_path).data)) == 1  # the 4 MiB default
    fraction = cfg.data.validation_fraction
    assert len(units) > 5 and decode_unit(encode_unit(units[2])) == units[2]
    streamed = {name: [] for name in SPLITS}
    figures = []
    for unit in units:
        documents, _ = unit_documents(unit, cfg.data, CHAT)
        for name in SPLITS:
            streamed[name].append(token_stream(documents[name], BYTES)[0])
        figures.append(pack_unit(unit, cfg.data, BYTES, 32, CHAT)[1])
    whole = {name: [] for name in SPLITS}
    for key, document in _keyed(cfg, files, entries):
        whole[SPLITS[in_validation(key, fraction, cfg.data.split_seed)]].append(document)
    counts, skipped = merge_figures(figures)
    for name in SPLITS:
        # The per-unit streams, joined, are the whole split's stream: same tokens, same order.
        expected = token_stream(whole[name], BYTES)[0]
        assert np.array_equal(np.concatenate(streamed[name]), expected)
        assert counts["tokens"][name] == len(expected)
        kept = counts["windows"][name] + counts["unlearnt_windows"][name]
        assert kept * 32 + counts["dropped_tokens"][name] == len(expected)
    assert skipped == [0, None]


def test_figures_sum_and_name_the_first_bad_row_in_unit_order():
    def figure(windows, skipped):
        counts = {"windows": {"train": windows, "validation": 1}}
        return {"counts": counts, "skipped": skipped}

    counts, skipped = merge_figures(
        [figure(3, [0, None]), figure(4, [2, "a:7: x"]), figure(1, [1, "b:1: y"])]
    )
    assert counts["windows"] == {"train": 8, "validation": 3}
    assert skipped == [3, "a:7: x"]


def test_the_streaming_rule_and_its_fingerprint(tmp_path):
    _corpus(tmp_path)
    small = _cfg(tmp_path)
    forced = _cfg(tmp_path, "data.feed=ray_data")
    assert not find_sources(small).streaming and find_sources(forced).streaming
    assert find_sources(small).fingerprint != find_sources(forced).fingerprint
    # The corpus is ~0.1 MiB: above a 0.01 MiB threshold 'auto' streams it, as 'ray_data' does.
    low = _cfg(tmp_path, "data.stream_above_mib=0.01")
    assert find_sources(low).streaming
    assert find_sources(low).fingerprint == find_sources(forced).fingerprint
    files, entries = _sources(_cfg(tmp_path, "data.feed=memory"))
    assert not streams(
        _cfg(tmp_path, "data.feed=memory", "data.stream_above_mib=0.01"), files, entries
    )
    # The unit size changes the streamed rows (each unit's tail is dropped), not the in-memory.
    units = "data.stream_unit_mib=1"
    assert find_sources(_cfg(tmp_path, units)).fingerprint == find_sources(small).fingerprint
    streamed = find_sources(_cfg(tmp_path, "data.feed=ray_data", units))
    assert streamed.fingerprint != find_sources(forced).fingerprint


@pytest.mark.parametrize("field", ["stream_above_mib", "stream_unit_mib"])
def test_streaming_sizes_are_positive(tmp_path, field):
    with pytest.raises(ConfigError, match=f"data.{field}: Input should be greater than 0"):
        _cfg(tmp_path, f"data.{field}=0")


def test_units_figures_are_kept_once_and_the_first_bad_row_by_unit_order():
    figures = _Figures()
    assert figures.first_error() is None
    figures.record(2, {"n": 1})
    figures.record(0, {"n": 2})
    figures.record(2, {"n": 3})  # a retried unit replaces its own figures
    assert figures.in_order() == [{"n": 2}, {"n": 3}]
    figures.fail(5, "b.jsonl:3: not valid JSON (x)")
    figures.fail(1, "a.jsonl:9: 'text' is empty")
    assert figures.first_error() == "a.jsonl:9: 'text' is empty"


def test_a_written_split_replaces_the_earlier_one(tmp_path):
    written = tmp_path / "staging" / "split=train"
    written.mkdir(parents=True)
    (written / "a.parquet").write_bytes(b"x")
    target = tmp_path / "out" / "train.parquet"
    target.parent.mkdir()
    target.write_bytes(b"old file")
    _move_split(written, target)
    assert [p.name for p in target.iterdir()] == ["a.parquet"]
    other = tmp_path / "staging" / "split=validation"
    other.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds files other than Parquet"):
        _move_split(other, target)
    assert (target / "notes.txt").exists()


def test_the_chat_template_travels_to_workers():
    template = ChatTemplate(DEFAULT_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>")
    again = pickle.loads(pickle.dumps(template))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert again.pieces(messages) == template.pieces(messages)
    assert (
        hashlib.sha256(again.source.encode()).digest()
        == hashlib.sha256(DEFAULT_CHAT_TEMPLATE.encode()).digest()
    )
