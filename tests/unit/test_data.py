import numpy as np
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


def _parts(parts, **kwargs):
    from raylane.data.memory import memory_batches

    features = np.arange(23, dtype=np.float32).reshape(23, 1)
    labels = np.arange(23, dtype=np.int64)
    return [
        [y.tolist() for _, y in memory_batches(features, labels, part=p, parts=parts, **kwargs)]
        for p in range(parts)
    ]


def test_memory_feed_parts_split_each_global_batch_in_one_seeded_order():
    (alone,) = _parts(1, batch_size=8, shuffle_seed=7)
    assert alone == _parts(1, batch_size=8, shuffle_seed=7)[0]  # the seed fixes the order
    assert alone != _parts(1, batch_size=8, shuffle_seed=8)[0]
    assert sorted(sum(alone, [])) == list(range(23))
    # Three replicas of batch 3 see the 1-replica run's batches of 9 rows, each a disjoint third.
    (wide,) = _parts(1, batch_size=9, shuffle_seed=7)
    three = _parts(3, batch_size=3, shuffle_seed=7)
    assert [len(batches) for batches in three] == [3, 3, 3]
    for step, batch in enumerate(wide):
        assert sum((replica[step] for replica in three), []) == batch
    # The last global batch (5 rows) is split 1/2/2; with drop_last it is gone.
    assert [len(replica[-1]) for replica in three] == [1, 2, 2]
    assert [len(b) for b in _parts(3, batch_size=3, shuffle_seed=7, drop_last=True)] == [2] * 3


def test_memory_feed_drops_a_last_batch_too_small_for_every_replica():
    # 23 rows in global batches of 11 leaves 1 row: 2 replicas cannot both step on it.
    halves = _parts(2, batch_size=11, shuffle_seed=None)
    assert halves == [[list(range(0, 11))], [list(range(11, 22))]]
    assert _parts(1, batch_size=10)[0][-1] == [20, 21, 22]
    with pytest.raises(ValueError, match="part 2 of 2"):
        from raylane.data.memory import memory_batches

        next(memory_batches(np.zeros((2, 1)), np.zeros(2), batch_size=1, part=2, parts=2))


def test_memory_feed_is_chosen_for_small_cached_splits(tmp_path):
    from raylane.data.ray_datasets import uses_memory_feed

    ensure_dataset(_cfg(tmp_path))
    assert uses_memory_feed(_cfg(tmp_path))
    assert not uses_memory_feed(_cfg(tmp_path, **{"data.cache": "false"}))
    assert not uses_memory_feed(_cfg(tmp_path, **{"data.feed": "ray_data"}))
    with pytest.raises(ValueError, match="data.feed 'memory' holds the splits"):
        _cfg(tmp_path, **{"data.feed": "memory", "data.cache": "false"})
