import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylane.config import load_config
from raylane.data import DataError, check_parquet, dataset_digest, ensure_dataset

from .test_config import REFERENCE


def _cfg(tmp_path, **extra):
    overrides = [
        f"data.train_path={tmp_path}/train.parquet",
        f"data.validation_path={tmp_path}/validation.parquet",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    return load_config(REFERENCE, overrides)


def test_prepare_is_deterministic_and_complete(tmp_path):
    train, validation = ensure_dataset(_cfg(tmp_path / "a"))
    assert train.rows + validation.rows == 1797
    assert validation.rows == pytest.approx(0.2 * 1797, abs=1)
    assert train.features == 64
    ensure_dataset(_cfg(tmp_path / "b"))
    first = dataset_digest(tmp_path / "a" / "train.parquet", tmp_path / "a" / "validation.parquet")
    second = dataset_digest(tmp_path / "b" / "train.parquet", tmp_path / "b" / "validation.parquet")
    assert first == second
    assert first != dataset_digest(tmp_path / "a" / "train.parquet")


def test_missing_user_parquet_is_an_error(tmp_path):
    cfg = load_config(
        REFERENCE,
        [
            "data.source=parquet",
            f"data.train_path={tmp_path}/none.parquet",
            f"data.validation_path={tmp_path}/none.parquet",
        ],
    )
    with pytest.raises(DataError, match="no Parquet files found"):
        ensure_dataset(cfg)


def _write(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"pixels": [[0.0] * 64], "label": [1]}, "column 'features' not found"),
        ({"features": [[0.0] * 10], "label": [1]}, "rows have 10 features but model.input_dim"),
        ({"features": [[0.0] * 64], "label": [12]}, "labels span [12, 12]"),
        ({"features": [[0.0] * 64], "label": [1.5]}, "must be integer"),
        ({"features": [[0.0] * 64, [0.0] * 3], "label": [1, 2]}, "different lengths"),
        ({"features": [1.0], "label": [1]}, "must hold lists of numbers"),
    ],
)
def test_bad_parquet_names_the_problem(tmp_path, columns, message):
    path = _write(tmp_path / "bad.parquet", columns)
    with pytest.raises(DataError) as info:
        check_parquet(path, _cfg(tmp_path))
    assert message in str(info.value)
    assert str(path) in str(info.value)
