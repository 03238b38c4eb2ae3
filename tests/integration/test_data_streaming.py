"""`data.source: files` streamed through Ray Data on the session cluster: the splits, manifest
and tokenizer the feeds read, windows equal to the units packed without Ray, and a bad row's
one-line error."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from raylane.data import DataError, ensure_dataset
from raylane.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from raylane.data.files import find_sources
from raylane.data.parquet import parquet_files, read_rows
from raylane.data.shards import SPLITS, pack_unit, plan_units
from raylane.data.streaming import WINDOW_ROW_BYTES
from raylane.data.tokenizer import BYTES
from tests.unit.test_user_data import _cfg, _corpus

pytestmark = pytest.mark.integration


def test_streamed_preparation_matches_its_units_packed_without_ray(
    ray_cluster, tmp_path, monkeypatch
):
    _corpus(tmp_path, rows=200)
    cfg = _cfg(tmp_path, "data.feed=ray_data")
    sources = find_sources(cfg)
    # Row groups of 16 windows: a reader decodes that much at a time, whatever a unit holds.
    monkeypatch.setattr(
        "raylane.data.streaming.ROW_GROUP_BYTES", 16 * cfg.model.input_dim * WINDOW_ROW_BYTES
    )
    train, validation = ensure_dataset(cfg)
    groups = [
        pq.ParquetFile(f).metadata.row_group(i).num_rows
        for f in parquet_files(cfg.data.train_path)
        for i in range(pq.ParquetFile(f).metadata.num_row_groups)
    ]
    assert max(groups) <= 16 < train.rows and sum(groups) == train.rows, groups
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["fingerprint"] == sources.fingerprint
    assert manifest["windows"] == {"train": train.rows, "validation": validation.rows}
    assert manifest["prepared_by"]["engine"] == "ray_data"
    assert len(parquet_files(cfg.data.train_path)) >= 1 and cfg.data.train_path.is_dir()

    chat = ChatTemplate(DEFAULT_CHAT_TEMPLATE, eos_token=BYTES.eot_token).pieces
    units = plan_units(
        sources.files, sources.entries, cfg.data, manifest["prepared_by"]["unit_bytes"]
    )
    tables = [pack_unit(unit, cfg.data, BYTES, 32, chat)[0] for unit in units]
    for name, path in zip(SPLITS, (cfg.data.train_path, cfg.data.validation_path), strict=True):
        inputs, labels = read_rows(path, cfg)
        expected = [t.filter(pc.equal(t["split"], name)) for t in tables]
        want = np.concatenate(
            [np.stack(t["features"].to_numpy(zero_copy_only=False)) for t in expected if len(t)]
        )
        # Rows in unit order (Ray Data keeps the order; files may be read in any order).
        assert sorted(map(bytes, inputs.astype(np.int64))) == sorted(map(bytes, want))
        assert (labels != -100).any() and inputs.shape[1] == 32

    assert ensure_dataset(cfg)[0].rows == train.rows  # up to date: not prepared again
    with (tmp_path / "corpus" / "rows.jsonl").open("a") as handle:
        handle.write("{not json\n")
    with pytest.raises(DataError, match=r"^\S*rows\.jsonl:601: not valid JSON \([^\n]*\)$"):
        ensure_dataset(cfg)
