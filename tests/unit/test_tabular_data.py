"""`data.source: files` with tables: CSV and Parquet files of one numeric column per feature and
an integer label, prepared as float32 feature rows and int64 labels for an mlp or cnn, with
one-line errors for bad columns and rows."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from raylane.config import ConfigError, load_config
from raylane.data import DataError, ensure_dataset
from raylane.data.files import prepare_files, stale_sources
from raylane.data.parquet import read_rows

from .test_config import ROOT

DIGITS = ROOT / "configs" / "train" / "digits_ddp.yaml"
LM = ROOT / "configs" / "train" / "lm_pipeline.yaml"
ROWS = 200
COLUMNS = ["age", "height", "weight", "score"]


def _source(rows: int = ROWS) -> dict[str, np.ndarray]:
    """Four numeric features (`age` is the row number: every row told apart) and a label 0..2."""
    rng = np.random.default_rng(7)
    return {
        "age": np.arange(rows, dtype=np.int64),
        "height": rng.normal(170.0, 10.0, rows).round(3),
        "weight": rng.normal(70.0, 5.0, rows).round(3),
        "score": rng.integers(-50, 50, rows).astype(np.float64) / 4,
        "label": rng.integers(0, 3, rows),
    }


def _write(path: Path, columns: dict[str, list | np.ndarray]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({name: pa.array(values) for name, values in columns.items()})
    if path.suffix == ".csv":
        pacsv.write_csv(table, path, pacsv.WriteOptions(quoting_style="none"))
    else:
        pq.write_table(table, path)
    return path


def _cfg(tmp_path: Path, files: list[Path], out: str = "out", **overrides):
    values = {
        "data.source": "files",
        "data.files": [str(path) for path in files],
        "data.train_path": str(tmp_path / out / "train.parquet"),
        "data.validation_path": str(tmp_path / out / "validation.parquet"),
        "model.input_dim": 4,
        "model.num_classes": 3,
        **overrides,
    }
    return load_config(DIGITS, values)


def _prepare(cfg) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    prepare_files(cfg)
    return read_rows(cfg.data.train_path, cfg), read_rows(cfg.data.validation_path, cfg)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_table_is_prepared_as_feature_rows(tmp_path, suffix):
    source = _source()
    path = _write(tmp_path / f"people{suffix}", source)
    cfg = _cfg(tmp_path, [path])
    assert cfg.data.tabular
    (x_train, y_train), (x_val, y_val) = _prepare(cfg)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert x_train.shape == (160, 4) and x_val.shape == (40, 4)
    assert y_train.shape == (160,) and y_val.shape == (40,)
    # every source row exactly once, across the two splits
    ages = np.concatenate([x_train[:, 0], x_val[:, 0]])
    assert sorted(ages.astype(int).tolist()) == list(range(ROWS))
    # a picked row has the source's values and label, in the source's column order
    features, labels = np.concatenate([x_train, x_val]), np.concatenate([y_train, y_val])
    (at,) = np.flatnonzero(features[:, 0] == 137)
    expected = [source[name][137] for name in COLUMNS]
    np.testing.assert_allclose(features[at], np.array(expected, dtype=np.float32))
    assert labels[at] == source["label"][137]
    assert set(labels.tolist()) == {0, 1, 2}
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["feature_columns"] == COLUMNS
    assert manifest["rows"] == {"train": 160, "validation": 40}
    assert manifest["skipped_rows"] == 0
    assert manifest["files"][0]["format"] == suffix[1:]
    assert manifest["files"][0]["bytes"] == path.stat().st_size
    assert len(manifest["files"][0]["sha256"]) == 64


def test_split_is_deterministic_by_seed(tmp_path):
    path = _write(tmp_path / "people.csv", _source())
    first = _prepare(_cfg(tmp_path, [path], out="a"))
    again = _prepare(_cfg(tmp_path, [path], out="b"))
    other = _prepare(_cfg(tmp_path, [path], out="c", **{"data.split_seed": 1}))
    np.testing.assert_array_equal(first[1][0], again[1][0])
    np.testing.assert_array_equal(first[0][1], again[0][1])
    assert set(first[1][0][:, 0].tolist()) != set(other[1][0][:, 0].tolist())
    assert len(other[1][0]) == 40


def test_files_are_concatenated_in_sorted_order(tmp_path):
    source = _source()
    for name, rows in (("c.parquet", slice(150, None)), ("b.csv", slice(80, 150))):
        _write(tmp_path / "tables" / name, {key: values[rows] for key, values in source.items()})
    _write(tmp_path / "tables" / "a.csv", {key: values[:80] for key, values in source.items()})
    patterns = [tmp_path / "tables" / "*.csv", tmp_path / "tables" / "*.parquet"]
    cfg = _cfg(tmp_path, patterns, **{"data.validation_fraction": 0.5})
    (x_train, _), (x_val, _) = _prepare(cfg)
    assert len(x_train) == len(x_val) == ROWS // 2
    # each split keeps file order: a.csv's rows (age < 80), b.csv's, then c.parquet's
    for ages in (x_train[:, 0], x_val[:, 0]):
        assert np.all(np.diff(ages) > 0)
    assert sorted(np.concatenate([x_train, x_val])[:, 0].tolist()) == list(range(ROWS))
    files = json.loads((tmp_path / "out" / "manifest.json").read_text())["files"]
    assert [Path(entry["path"]).name for entry in files] == ["a.csv", "b.csv", "c.parquet"]


def test_feature_columns_pick_and_order(tmp_path):
    source = _source()
    path = _write(tmp_path / "people.csv", {**source, "city": ["x"] * ROWS})
    cfg = _cfg(tmp_path, [path], **{"data.feature_columns": ["score", "age"], "model.input_dim": 2})
    (x_train, _), (x_val, _) = _prepare(cfg)
    features = np.concatenate([x_train, x_val])
    assert features.shape == (ROWS, 2)
    (at,) = np.flatnonzero(features[:, 1] == 42)
    assert features[at, 0] == np.float32(source["score"][42])


def _error(tmp_path, columns: dict, name: str = "x.csv", **overrides) -> str:
    path = _write(tmp_path / name, columns)
    with pytest.raises(DataError) as caught:
        prepare_files(_cfg(tmp_path, [path], **overrides))
    return str(caught.value)


def test_non_numeric_feature_columns_are_named(tmp_path):
    source = _source(10)
    columns = {"name": ["n"] * 10, **source, "city": ["c"] * 10}
    message = _error(tmp_path, columns, **{"model.input_dim": 6})
    assert message == (
        f"{tmp_path / 'x.csv'}: non-numeric feature columns ['city', 'name']; list "
        "data.feature_columns or encode them"
    )


def test_missing_columns_name_the_file_and_its_columns(tmp_path):
    source = _source(10)
    message = _error(tmp_path, source, **{"data.feature_columns": ["age", "agee", "height", "x"]})
    assert message == (
        f"{tmp_path / 'x.csv'}: columns ['agee', 'x'] not found "
        "(columns: age, height, weight, score, label)"
    )
    unlabelled = {name: values for name, values in source.items() if name != "label"}
    message = _error(tmp_path, unlabelled, name="y.parquet", **{"data.label_column": "class"})
    assert message.endswith(
        "y.parquet: columns ['class'] not found (columns: age, height, weight, score)"
    )


def test_input_dim_must_match_the_feature_columns(tmp_path):
    message = _error(tmp_path, _source(10), **{"model.input_dim": 5})
    assert message == (
        f"{tmp_path / 'x.csv'}: 4 feature columns ['age', 'height', 'weight', 'score'] but "
        "model.input_dim is 5"
    )


def test_labels_must_be_classes(tmp_path):
    source = _source(10)
    fractional = {**source, "label": [0, 1, 2, 1.5, 0, 1, 2, 0, 1, 2]}
    assert _error(tmp_path, fractional) == f"{tmp_path / 'x.csv'}:5: label 1.5 is not an integer"
    outside = {**source, "label": [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]}
    assert _error(tmp_path, outside, name="y.csv") == (
        f"{tmp_path / 'y.csv'}:8: label 3 is outside [0, 3) (model.num_classes)"
    )
    negative = {**source, "label": [0, 1, -1, 0, 1, 2, 0, 0, 1, 2]}
    assert _error(tmp_path, negative, name="z.parquet") == (
        f"{tmp_path / 'z.parquet'}:3: label -1 is outside [0, 3) (model.num_classes)"
    )
    flags = {**source, "label": [True, False] * 5}
    assert _error(tmp_path, flags, name="f.parquet") == (
        f"{tmp_path / 'f.parquet'}:1: label True is not an integer (column 'label' holds bool)"
    )
    texts = {**source, "label": [str(label) for label in source["label"]]}
    path = _write(tmp_path / "t.parquet", texts)
    (x_train, y_train), (x_val, y_val) = _prepare(_cfg(tmp_path, [path]))
    labels = np.concatenate([y_train, y_val])[np.argsort(np.concatenate([x_train, x_val])[:, 0])]
    np.testing.assert_array_equal(labels, source["label"])
    words = {**source, "label": ["0", "1", "cat"] + ["1"] * 7}
    assert _error(tmp_path, words, name="w.csv") == (
        f"{tmp_path / 'w.csv'}:4: label 'cat' is not an integer (column 'label' holds string)"
    )


def test_empty_value_names_the_csv_line(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text(
        "age,height,weight,score,label\n1,2,3,4,0\n5,6,7,8,1\n\n9,,11,12,2\n3,2,1,0,1\n"
    )
    with pytest.raises(DataError) as caught:
        prepare_files(_cfg(tmp_path, [path]))
    assert str(caught.value) == f"{path}:5: empty value in column 'height'"


def test_nan_names_the_parquet_row(tmp_path):
    source = _source(10)
    weight = source["weight"].copy()
    weight[6] = np.nan
    message = _error(tmp_path, {**source, "weight": weight}, name="x.parquet")
    assert message == f"{tmp_path / 'x.parquet'}:7: empty value in column 'weight'"
    weight[6], weight[3] = 1.0, -np.inf
    message = _error(tmp_path, {**source, "weight": weight}, name="y.parquet")
    assert message == f"{tmp_path / 'y.parquet'}:4: infinite value in column 'weight'"


def test_bad_rows_are_skipped_and_counted(tmp_path, caplog):
    source = _source()
    height, label = source["height"].copy(), source["label"].astype(np.float64)
    height[[10, 20]] = np.nan
    label[30] = np.nan
    path = _write(tmp_path / "x.csv", {**source, "height": height, "label": label})
    cfg = _cfg(tmp_path, [path], **{"data.on_bad_rows": "skip"})
    with caplog.at_level(logging.WARNING, logger="raylane"):
        (x_train, _), (x_val, _) = _prepare(cfg)
    assert len(x_train) + len(x_val) == ROWS - 3
    assert not {10.0, 20.0, 30.0} & set(np.concatenate([x_train, x_val])[:, 0].tolist())
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped_rows"] == 3
    assert manifest["first_skipped"] == f"{path}:12: empty value in column 'height'"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"data.files: skipped 3 bad rows (data.on_bad_rows: skip); the first: {path}:12: empty "
        "value in column 'height'"
    )


def test_unreadable_file_is_an_error_or_skipped(tmp_path):
    good = _write(tmp_path / "a.csv", _source())
    broken = tmp_path / "b.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=rf"^{broken}: unreadable parquet \("):
        prepare_files(_cfg(tmp_path, [good, broken]))
    cfg = _cfg(tmp_path, [good, broken], **{"data.on_bad_rows": "skip"})
    assert prepare_files(cfg) == (160, 40)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped_rows"] == 1


def test_changed_file_is_prepared_again(tmp_path):
    path = _write(tmp_path / "x.csv", _source())
    cfg = _cfg(tmp_path, [path])
    sources = stale_sources(cfg)
    assert sources is not None
    prepare_files(cfg, sources)
    assert stale_sources(cfg) is None
    first = json.loads((tmp_path / "out" / "manifest.json").read_text())["fingerprint"]
    _write(path, _source(150))
    sources = stale_sources(cfg)
    assert sources is not None and sources.fingerprint != first
    assert prepare_files(cfg, sources) == (120, 30)
    assert stale_sources(cfg) is None
    # a data field re-prepares too
    assert stale_sources(_cfg(tmp_path, [path], **{"data.split_seed": 3})) is not None


def test_tables_and_documents_do_not_mix(tmp_path):
    table = _write(tmp_path / "x.csv", _source(10))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    cfg = load_config(LM, {"data.source": "files", "data.files": [str(table), str(notes)]})
    with pytest.raises(DataError) as caught:
        prepare_files(cfg)
    assert str(caught.value) == (
        f"{notes}: data.format 'auto' reads .txt, .md, .py, .rst as text, .jsonl as JSON lines "
        f"and .csv, .parquet as tables; data.files mixes tables and documents (the first: "
        f"{table}), a run reads one kind"
    )


def test_config_wants_a_classifier_for_tables(tmp_path):
    table = _write(tmp_path / "x.csv", _source(10))
    cnn = _cfg(tmp_path, [table], **{"model.kind": "cnn"})
    assert cnn.data.tabular and cnn.model.kind == "cnn"
    forced = _cfg(tmp_path, [tmp_path / "x.dat"], **{"data.format": "parquet"})
    assert forced.data.tabular
    with pytest.raises(ConfigError, match="model.kind must be 'mlp' or 'cnn', not 'gpt'"):
        load_config(LM, {"data.source": "files", "data.files": [str(table)]})
    # text files still want a language model
    with pytest.raises(ConfigError, match="is token data: model.kind must be 'gpt' or 'llama'"):
        _cfg(tmp_path, [tmp_path / "*.txt"])
    assert not load_config(LM, {"data.source": "files", "data.files": ["a/*"]}).data.tabular


def test_feature_columns_are_checked(tmp_path):
    table = _write(tmp_path / "x.csv", _source(10))
    with pytest.raises(ConfigError, match="without the label column 'label'"):
        _cfg(tmp_path, [table], **{"data.feature_columns": ["age", "label"]})
    with pytest.raises(ConfigError, match="expected distinct columns"):
        _cfg(tmp_path, [table], **{"data.feature_columns": ["age", "age"]})


def test_the_first_rows_of_a_split_of_several_files_and_row_groups(tmp_path):
    split = tmp_path / "train.parquet"
    split.mkdir()
    for part in range(2):  # 2 files of 3 row groups of 2 rows: rows 6 * part + 0..5
        rows = np.arange(6 * part, 6 * part + 6)
        table = pa.table({"features": [[float(r)] * 4 for r in rows], "label": rows % 3})
        pq.write_table(table, split / f"part-{part}.parquet", row_group_size=2)
    cfg = _cfg(tmp_path, [tmp_path / "unused.csv"])
    whole, labels = read_rows(split, cfg)
    assert whole[:, 0].tolist() == list(range(12))
    for limit in (1, 5, 7, 12, 20):
        head, head_labels = read_rows(split, cfg, limit=limit)
        np.testing.assert_array_equal(head, whole[:limit])
        np.testing.assert_array_equal(head_labels, labels[:limit])


def test_ensure_dataset_prepares_a_csv_for_the_digits_config(tmp_path):
    source = _source()
    path = _write(tmp_path / "people.csv", source)
    cfg = _cfg(tmp_path, [path])
    train, validation = ensure_dataset(cfg)
    assert (train.rows, train.features) == (160, 4)
    assert (validation.rows, validation.features) == (40, 4)
    assert cfg.model.kind == "mlp" and cfg.parallelism.strategy == "ddp"
    x_train, y_train = read_rows(cfg.data.train_path, cfg, limit=5)
    assert x_train.shape == (5, 4) and y_train.dtype == np.int64
    row = int(x_train[0, 0])
    assert y_train[0] == source["label"][row]
    np.testing.assert_allclose(x_train[0, 1], source["height"][row], rtol=1e-6)
    # the second call finds the splits up to date
    stamp = Path(cfg.data.train_path).stat().st_mtime_ns
    ensure_dataset(cfg)
    assert Path(cfg.data.train_path).stat().st_mtime_ns == stamp
