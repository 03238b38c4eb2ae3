from pathlib import Path

import pytest

from raylane.config import ConfigError
from raylane.tune.candidates import enumerate_candidates, trial_config
from raylane.tune.predicted import profile_input
from raylane.tune.spec import TuneSpec, is_search_spec, load_spec

ROOT = Path(__file__).resolve().parents[2]


def _spec(**search) -> TuneSpec:
    budget = search.pop("cpus", 2.0)
    per_worker = search.pop("cpus_per_worker", 0.45)
    return TuneSpec.model_validate(
        {
            "experiment": "t",
            "base": str(ROOT / "configs" / "train" / "lm_pipeline.yaml"),
            "search": {"batch_size": [32], **search},
            "constraints": {"cpus": budget, "cpus_per_worker": per_worker},
        }
    )


def _layouts(candidates):
    return sorted(
        (
            c.overrides["parallelism.strategy"],
            c.overrides["parallelism.dp"],
            c.overrides["parallelism.pp"],
            c.overrides["parallelism.microbatches"],
        )
        for c in candidates
    )


def test_valid_layouts_for_a_four_worker_budget_are_exactly_these():
    spec = _spec(strategy=["ddp", "pipeline", "hybrid"], workers=[1, 2, 3, 4], pp=[2, 4],
                 microbatches=[1, 2, 4])  # fmt: skip
    valid, pruned = enumerate_candidates(spec)
    assert _layouts(valid) == [
        ("ddp", 1, 1, 1),
        ("ddp", 2, 1, 1),
        ("ddp", 3, 1, 1),
        ("ddp", 4, 1, 1),
        ("hybrid", 2, 2, 2),
        ("hybrid", 2, 2, 4),
        ("pipeline", 1, 2, 2),
        ("pipeline", 1, 2, 4),
        ("pipeline", 1, 4, 4),
    ]
    reasons = {p.candidate.key: p.reason for p in pruned}
    assert "microbatches (1) must be at least pp (2)" in reasons["pipeline-w2-dp1xpp2-m1-b32"]
    assert "microbatches (2) must be at least pp (4)" in reasons["pipeline-w4-dp1xpp4-m2-b32"]
    assert "use 'hybrid' for dp > 1" in reasons["pipeline-w4-dp2xpp2-m4-b32"]
    assert "hybrid' needs dp >= 2" in reasons["hybrid-w4-dp1xpp4-m4-b32"]
    assert "needs pp >= 2" in reasons["pipeline-w3-dp3xpp1-m2-b32"]
    assert all(reason for reason in reasons.values())


def test_cpu_budget_prunes_large_worker_groups_with_the_numbers():
    valid, pruned = enumerate_candidates(_spec(strategy=["ddp"], workers=[2, 4], cpus=1.0))
    assert _layouts(valid) == [("ddp", 2, 1, 1)]
    (item,) = pruned
    assert item.reason == (
        "needs 1.81 CPUs (4 workers x 0.45 + 0.01 for the trial driver), budget is 1"
    )


def test_a_group_that_fills_the_budget_is_pruned_since_its_driver_needs_a_share_too():
    # 4 x 0.5 = 2 CPUs plus the trial driver's share cannot start on 2 CPUs: Ray would wait
    # for the worker group forever.
    valid, pruned = enumerate_candidates(
        _spec(strategy=["ddp"], workers=[2, 4], cpus=2.0, cpus_per_worker=0.5)
    )
    assert _layouts(valid) == [("ddp", 2, 1, 1)]
    assert [p.candidate.key for p in pruned] == ["ddp-w4-dp4xpp1-m1-b32"]


def test_compression_is_pruned_where_nothing_is_all_reduced_through_ddp():
    valid, pruned = enumerate_candidates(
        _spec(
            strategy=["ddp", "pipeline"],
            workers=[1, 2],
            microbatches=[2],
            grad_compression=["none", "powersgd"],
        )  # fmt: skip
    )
    assert "ddp-w2-dp2xpp1-m1-b32-powersgd" in {c.key for c in valid}
    reasons = {p.candidate.key: p.reason for p in pruned}
    assert reasons["ddp-w1-dp1xpp1-m1-b32-powersgd"] == (
        "one worker all-reduces no gradients: nothing to compress"
    )
    assert "strategy 'pipeline' does not" in reasons["pipeline-w2-dp1xpp2-m2-b32-powersgd"]


def test_extra_dimensions_and_trial_length_reach_the_config():
    spec = _spec(strategy=["ddp"], workers=[2], extra={"training.lr": [0.001, 0.01]})
    valid, _ = enumerate_candidates(spec)
    assert sorted(c.overrides["training.lr"] for c in valid) == [0.001, 0.01]
    cfg = trial_config(spec, valid[0])
    assert cfg.training.epochs == spec.trial.epochs
    assert cfg.training.steps_per_epoch == spec.trial.steps_per_epoch
    full = trial_config(spec, valid[0], for_trial=False)
    assert full.training.steps_per_epoch is None and full.training.epochs == 3


def test_shipped_spec_validates_and_bad_specs_name_the_field(tmp_path):
    load_spec(ROOT / "configs" / "tune" / "parallelism.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiment: x\nbase: configs/train/lm_pipeline.yaml\ntrial: {epochs: 1}\n")
    with pytest.raises(ConfigError, match="trial.epochs: Input should be greater than or equal"):
        load_spec(bad)
    with pytest.raises(ConfigError, match="warmup_epochs \\(2\\) leaves no measured epoch of 2"):
        load_spec(bad, ["trial.epochs=2", "trial.warmup_epochs=2"])


def test_trial_configs_carry_absolute_paths_whatever_the_trials_directory(monkeypatch):
    # The shipped spec's base config names relative data paths; a Tune trial runs in its own
    # working directory, so they are resolved where the search was started.
    monkeypatch.chdir(ROOT)
    spec = load_spec(ROOT / "configs" / "tune" / "parallelism.yaml")
    valid, _ = enumerate_candidates(spec)
    cfg = trial_config(spec, valid[0])
    assert cfg.data.train_path == (ROOT / "data" / "stdlib" / "train.parquet").resolve()
    assert cfg.data.validation_path.is_absolute() and cfg.training.storage_path.is_absolute()
    winner = trial_config(spec, valid[0], for_trial=False)
    assert not winner.data.train_path.is_absolute()  # the emitted config stays portable


def test_tensor_parallel_and_fsdp_layouts_are_searched_and_impossible_ones_named():
    spec = _spec(strategy=["tp", "fsdp"], workers=[1, 2, 4], tp=[2, 4], cpus=4.0,
                 cpus_per_worker=0.25)  # fmt: skip
    valid, pruned = enumerate_candidates(spec)
    found = sorted(
        (c.overrides["parallelism.strategy"], c.overrides["parallelism.dp"],
         c.overrides["parallelism.pp"], c.overrides["parallelism.tp"]) for c in valid
    )  # fmt: skip
    assert found == [
        ("fsdp", 1, 1, 1),  # one worker: nothing to shard, still a valid run
        ("fsdp", 2, 1, 1),
        ("fsdp", 2, 1, 2),
        # pipeline x FSDP: each of 2 stages sharded over 2 workers, at 2 and 4 micro-batches
        ("fsdp", 2, 2, 1),
        ("fsdp", 2, 2, 1),
        ("fsdp", 4, 1, 1),
        ("tp", 1, 1, 2),
        ("tp", 1, 1, 4),
        ("tp", 2, 1, 2),
    ]
    reasons = {c.key: r for c, r in ((p.candidate, p.reason) for p in pruned)}
    assert any("workers (1) is not divisible by tp (2)" in r for r in reasons.values())
    assert "tp-w4-dp2xpp1-tp2-m1-b32" in {c.key for c in valid}
    # FSDP with one shard per tensor-parallel group is tensor parallelism: one trial, not two.
    assert reasons["fsdp-w2-dp1xpp1-tp2-m1-b32"] == "the same layout as tp-w2-dp1xpp1-tp2-m1-b32"
    assert reasons["fsdp-w4-dp1xpp1-tp4-m1-b32"] == "the same layout as tp-w4-dp1xpp1-tp4-m1-b32"


def test_context_and_sequence_parallel_layouts_are_searched_where_they_run():
    spec = _spec(strategy=["ddp", "tp", "pipeline"], workers=[1, 2, 4], tp=[2], cp=[1, 2],
                 sequence_parallel=[False, True], microbatches=[2], cpus=4.0,
                 cpus_per_worker=0.25)  # fmt: skip
    valid, pruned = enumerate_candidates(spec)
    split = sorted(c.key for c in valid if c.overrides["parallelism.cp"] > 1)
    assert split == [
        "ddp-w2-dp1xpp1-cp2-m1-b32",  # each sequence over both workers
        "ddp-w4-dp2xpp1-cp2-m1-b32",  # 2 replicas x cp 2
        "tp-w4-dp1xpp1-tp2-cp2-m1-b32",  # cp 2 x tp 2, with and without sequence parallelism
        "tp-w4-dp1xpp1-tp2-cp2-sp-m1-b32",
    ]
    assert not any(c.overrides["parallelism.sequence_parallel"] for c in valid
                   if c.overrides["parallelism.tp"] == 1)  # fmt: skip
    assert all(c.overrides["parallelism.cp"] == 1 for c in valid
               if c.overrides["parallelism.strategy"] == "pipeline")  # fmt: skip
    reasons = {p.candidate.key: p.reason for p in pruned}
    assert "workers (1) is not divisible by cp (2)" in reasons["ddp-w1-dp1xpp1-cp2-m1-b32"]
    assert "not divisible by tp * cp (2 * 2)" in reasons["tp-w2-dp1xpp1-tp2-cp2-m1-b32"]
    # A written winner is a config the training loader accepts, cp and all.
    cfg = trial_config(spec, next(c for c in valid if c.key.endswith("cp2-sp-m1-b32")),
                       for_trial=False)  # fmt: skip
    assert (cfg.parallelism.cp, cfg.parallelism.tp, cfg.parallelism.sequence_parallel) == (
        2, 2, True,
    )  # fmt: skip


def test_the_profile_of_a_search_is_its_widest_layout_at_each_worker_count():
    shipped = ROOT / "configs" / "tune" / "parallelism.yaml"
    assert is_search_spec(shipped)
    assert not is_search_spec(ROOT / "configs" / "train" / "lm_pipeline.yaml")
    spec = load_spec(shipped)
    valid, _ = enumerate_candidates(spec)
    base, levels = profile_input(spec, valid)
    assert levels == [1, 2, 4]
    assert base.parallelism.workers == 4 and base.data.max_bytes == 131072  # base_overrides
