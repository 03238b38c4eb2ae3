"""The run differ behind `raylane compare` and `raylane reproduce`."""

from raylane.reproduce import INFORMATIONAL, PRECONDITIONS, drift_table
from raylane.tracking.compare import differences, first_divergence


def _record(changes: dict[tuple[str, str], str] | None = None) -> dict:
    record = {
        "code": {"raylane.code_digest": "a" * 64, "git commit": "c1", "git dirty": "False"},
        "data": {"dataset digest": "d1"},
        "versions": {"torch": "2.13.0", "ray": "2.60.0"},
        "cluster": {"nodes": "1", "cpus": "2", "gpus": "0"},
        "config": {"training.lr": "0.002"},
        "metrics": {"val_loss": "0.5"},
        "weights": {"raylane.weights_digest": "w1"},
    }
    for (section, key), value in (changes or {}).items():
        record[section][key] = value
    return record


def test_identical_records_have_no_differences():
    assert differences(_record(), _record()) == []


def test_each_differing_key_is_named_with_both_values():
    changed = _record({("config", "training.lr"): "0.003", ("data", "dataset digest"): "d2"})
    found = differences(_record(), changed)
    assert [(d.section, d.key, d.a, d.b) for d in found] == [
        ("data", "dataset digest", "d1", "d2"),
        ("config", "training.lr", "0.002", "0.003"),
    ]


def test_drift_table_marks_what_blocks_a_reproduction():
    _, drift = drift_table(_record(), _record({("versions", "torch"): "2.14.0"}), "r")
    assert [(d.section, d.key) for d in drift] == [("versions", "torch")]
    # A new commit is shown but does not block: the code digest decides.
    _, drift = drift_table(_record(), _record({("code", "git commit"): "c2"}), "r")
    assert all((d.section, d.key) in INFORMATIONAL for d in drift) and drift


def test_a_finetuning_runs_base_weights_are_a_precondition():
    base = {"base_model": "lm", "base_version": "3", "base_digest": "b1"}
    recorded = _record() | {"base": base}
    table, drift = drift_table(recorded, _record() | {"base": base}, "r")
    assert drift == [] and "base: base_digest" in [str(c) for c in table.columns[1]._cells]
    _, drift = drift_table(recorded, _record() | {"base": base | {"base_digest": "b2"}}, "r")
    assert [(d.section, d.key, d.a, d.b) for d in drift] == [("base", "base_digest", "b1", "b2")]
    assert not INFORMATIONAL & {(d.section, d.key) for d in drift}  # it blocks
    assert "config" not in PRECONDITIONS  # the config is the recorded one by construction


def test_first_divergence_names_the_epoch_metric_and_size():
    a = {"train_loss": [2.0, 1.0], "val_loss": [1.5, 0.9], "val_accuracy": [0.5, 0.8]}
    assert first_divergence(a, {k: list(v) for k, v in a.items()}) is None
    b = {**a, "val_loss": [1.5, 0.9000001]}
    assert first_divergence(a, b) == "epoch 2: val_loss 0.9 vs 0.9 (difference +1e-07)"
    assert first_divergence(a, {**a, "val_accuracy": [0.5]}) == (
        "epoch 2: val_accuracy missing in one run"
    )
