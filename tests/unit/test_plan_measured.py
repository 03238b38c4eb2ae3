"""The profile-based cost model and the planner's ranking, on a synthetic profile whose
figures make every prediction computable by hand."""

from pathlib import Path

import pytest

from raylane.config import ConfigError, load_config
from raylane.plan.measured import ProfileMismatch, predict_config
from raylane.tune.candidates import enumerate_candidates
from raylane.tune.predicted import rank_with_profile
from raylane.tune.spec import TuneSpec

ROOT = Path(__file__).resolve().parents[2]
LM = ROOT / "configs" / "train" / "lm_pipeline.yaml"
MS = 1e-3


def _fit(fixed_ms: float, per_row_ms: float) -> dict:
    return {"fixed_s": fixed_ms * MS, "per_row_s": per_row_ms * MS}


def _level(block_per_row_ms: float, ddp_wait_ms: float | None = None) -> dict:
    level = {
        "block": _fit(1.0, block_per_row_ms),
        "block_forward": _fit(0.5, block_per_row_ms / 3),
        "ends": _fit(0.5, 0.25),
        "optimizer_s_per_param": 1e-8,
    }
    if ddp_wait_ms is not None:
        level["all_reduce"] = {"alpha_s": 1 * MS, "beta_s_per_byte": 1e-9}
        level["ddp_wait"] = _fit(ddp_wait_ms, 0.0)
        level["schedules"] = {"gpipe": _fit(2.0, 1.0), "1f1b": _fit(2.0, 1.0)}
    return level


PROFILE = {
    "workers": 2,
    # Two workers share the cores: each computes a row 1.5x slower than one alone.
    "levels": {"1": _level(0.5), "2": _level(0.75, ddp_wait_ms=10.0)},
    "block_params": 50_000,
    "ends_params": 40_000,
    "block_activation_bytes_per_row": 300_000.0,
    "ends_activation_bytes_per_row": 30_000.0,
    "baseline_rss_mb": 400.0,
    "p2p": {"alpha_s": 0.1 * MS, "beta_s_per_byte": 0.3e-9},
}


def _cfg(*overrides: str):
    return load_config(LM, list(overrides))


def _ddp(workers: int, batch: int, *extra: str):
    return _cfg(
        "parallelism.strategy=ddp",
        "parallelism.pp=1",
        f"parallelism.workers={workers}",
        f"parallelism.dp={workers}",
        f"training.batch_size={batch}",
        *extra,
    )


def test_one_worker_ddp_is_blocks_ends_and_optimizer():
    predicted = predict_config(PROFILE, _ddp(1, 16))
    params = 4 * 50_000 + 40_000
    blocks = 4 * (1.0 + 0.5 * 16) * MS
    ends = (0.5 + 0.25 * 16) * MS
    assert predicted.step_s == pytest.approx(blocks + ends + 1e-8 * params)
    assert predicted.parts["comm"] == 0 and predicted.parts["bubble"] == 0
    assert predicted.samples_per_s == pytest.approx(16 / predicted.step_s)
    # AdamW: parameters, gradients and two moments in fp32; activations per row as profiled.
    state_mb = 16 * params / 2**20
    activations_mb = 16 * (4 * 300_000 + 30_000) / 2**20
    assert predicted.memory_mb == pytest.approx(400 + state_mb + activations_mb)


def test_two_workers_pay_the_measured_ddp_wait_and_compression_saves_bandwidth_only():
    plain = predict_config(PROFILE, _ddp(2, 16))
    assert plain.parts["comm"] == pytest.approx(10 * MS)
    assert plain.samples_per_s == pytest.approx(32 / plain.step_s)
    fp16 = predict_config(PROFILE, _ddp(2, 16, "parallelism.grad_compression=fp16"))
    saved = 0.5 * 1e-9 * 4 * (4 * 50_000 + 40_000)
    assert plain.parts["comm"] - fp16.parts["comm"] == pytest.approx(saved)


def test_pipeline_adds_bubble_and_schedule_cost_and_more_microbatches_shrink_the_bubble():
    def pipeline(micro: int):
        return predict_config(
            PROFILE, _cfg(f"parallelism.microbatches={micro}", "training.batch_size=32")
        )

    four, eight = pipeline(4), pipeline(8)
    rows = 32 / 4
    first = 2 * (1.0 + 0.75 * rows) * MS
    assert four.parts["bubble"] == pytest.approx(first)  # (pp - 1) x the first stage's slot
    assert eight.parts["bubble"] < four.parts["bubble"]
    assert four.parts["comm"] > (2.0 + 1.0 * 4) * MS  # the schedule's own cost, plus sends
    # Each stage holds half the blocks: less state than one worker's whole model.
    assert four.memory_mb < predict_config(PROFILE, _ddp(1, 32)).memory_mb


def test_activation_checkpointing_costs_a_forward_and_saves_memory():
    plain = predict_config(PROFILE, _ddp(1, 32))
    recompute = predict_config(PROFILE, _ddp(1, 32, "training.activation_checkpointing=true"))
    assert recompute.step_s - plain.step_s == pytest.approx(4 * (0.5 + 32 * 0.5 / 3) * MS)
    assert recompute.memory_mb < plain.memory_mb


def test_tensor_parallel_splits_per_row_compute_and_adds_activation_all_reduces():
    tp = predict_config(
        PROFILE,
        _cfg(
            "parallelism.strategy=tp",
            "parallelism.pp=1",
            "parallelism.tp=2",
            "parallelism.dp=1",
            "model.n_heads=4",
        ),  # fmt: skip
    )
    ddp = predict_config(PROFILE, _ddp(2, 32))
    assert tp.parts["compute"] < 2 * ddp.parts["compute"]
    assert tp.parts["compute"] > 0 and tp.parts["comm"] > 0


def test_a_worker_count_the_profile_did_not_measure_is_refused_by_name():
    with pytest.raises(ProfileMismatch, match="measured 1, 2 workers at a time, not 4"):
        predict_config(PROFILE, _ddp(4, 16))


def _spec(budget_mb: float, top_k: int) -> TuneSpec:
    return TuneSpec.model_validate(
        {
            "experiment": "t",
            "base": str(LM),
            "search": {
                "strategy": ["ddp", "pipeline"],
                "workers": [1, 2],
                "microbatches": [4, 8],
                "batch_size": [16, 32],
            },  # fmt: skip
            "constraints": {"cpus": 2.0, "cpus_per_worker": 0.5, "memory_mb_per_worker": budget_mb},
            "predict": {"top_k": top_k},
        }
    )


def test_planner_keeps_the_top_k_predicted_and_prunes_what_would_not_fit():
    spec = _spec(budget_mb=10_000, top_k=3)
    candidates, _ = enumerate_candidates(spec)
    ranking = rank_with_profile(spec, candidates, PROFILE)
    speeds = [ranking.predictions[c.key].samples_per_s for c in ranking.launch + ranking.not_run]
    assert len(ranking.launch) == 3 and speeds == sorted(speeds, reverse=True)
    assert len(ranking.launch) + len(ranking.not_run) == len(candidates)

    # A budget between the smallest and the largest prediction prunes, with the reason.
    memory = sorted(p.memory_mb for p in ranking.predictions.values())
    tight = _spec(budget_mb=(memory[0] + memory[-1]) / 2, top_k=3)
    ranked = rank_with_profile(tight, candidates, PROFILE)
    assert ranked.pruned and all("predicted peak" in p.reason for p in ranked.pruned)
    assert all(ranked.predictions[c.key].memory_mb <= tight.constraints.memory_mb_per_worker
               for c in ranked.launch)  # fmt: skip


def test_prediction_needs_a_language_model_base():
    spec = TuneSpec.model_validate(
        {
            "experiment": "t",
            "base": str(ROOT / "configs" / "train" / "digits_ddp.yaml"),
            "search": {"strategy": ["ddp"], "workers": [1]},
        }  # fmt: skip
    )
    from raylane.tune.predicted import rank_candidates

    with pytest.raises(
        ConfigError,
        match=r"^predict.enabled: model.kind 'mlp' is a classifier: "
        r"`raylane plan` plans language models .* set predict.enabled=false",
    ):
        rank_candidates(spec, enumerate_candidates(spec)[0])


def test_search_table_and_csv_put_predictions_next_to_measurements(tmp_path):
    from rich.console import Console

    from raylane.tune.report import print_table, rows, write_csv
    from raylane.tune.search import SearchOutcome, TrialOutcome, _calibrate

    spec = _spec(budget_mb=10_000, top_k=2)
    candidates, _ = enumerate_candidates(spec)
    ranking = rank_with_profile(spec, candidates, PROFILE, run_id="f" * 32)
    first, second = ranking.launch
    # The first trial took twice the predicted work plus 5 ms per step waiting for input.
    work_ms = ranking.predictions[first.key].step_ms
    second_raw = ranking.predictions[second.key].step_ms
    measured = [
        TrialOutcome(
            c,
            "ok",
            samples_per_s=100.0,
            step_ms=ms,
            data_wait_ms=5.0,
            peak_rss_mb=600.0,
            predicted=ranking.predictions[c.key],
        )
        for c, ms in ((first, 2 * work_ms + 5.0), (second, 50.0))
    ]
    calibration = _calibrate(measured, [c.key for c in ranking.launch])
    # The median of the two trials' ratios; each trial's own prediction by the other's.
    second_scale = (50.0 - 5.0) / second_raw
    assert calibration.layouts == (first.key, second.key)
    assert calibration.step_scale == pytest.approx((2.0 + second_scale) / 2)
    assert calibration.data_wait_s == pytest.approx(5e-3)
    assert measured[0].predicted.step_ms == pytest.approx(second_scale * work_ms + 5.0)
    assert measured[1].predicted.step_ms == pytest.approx(2 * second_raw + 5.0)
    offset = 600.0 - ranking.predictions[second.key].memory_mb  # what the second measured
    assert measured[0].predicted.memory_mb == pytest.approx(
        ranking.predictions[first.key].memory_mb + offset
    )
    not_run = [
        TrialOutcome(c, "not run", predicted=ranking.predictions[c.key]) for c in ranking.not_run
    ]
    outcome = SearchOutcome(measured, [], 12.0, not_run, "f" * 32, 3.0, calibration)
    console = Console(record=True, width=250)
    print_table(outcome, console)
    text = " ".join(console.export_text().split())
    assert "predictions: profile run ffff" in text
    assert f"step work x{(2.0 + second_scale) / 2:.2f}" in text
    assert "input wait 5.0 ms per step" in text
    assert "from the median of 2 measured trials" in text
    assert "median |predicted - measured| step time, each by the others" in text
    table = rows(outcome)
    assert [r["status"] for r in table].count("not run") == len(ranking.not_run)
    assert all(r["predicted_step_ms"] > 0 for r in table)
    assert write_csv(outcome, tmp_path / "t.csv").read_text().count("not run") == len(not_run)


def test_searcher_suggests_best_first_and_stops_once_the_rest_cannot_win():
    from ray.tune.search import Searcher

    from raylane.plan.measured import LocalPrediction
    from raylane.tune.predicted import PredictedFirst

    def predicted(samples_per_s: float) -> LocalPrediction:
        step = 32 / samples_per_s
        return LocalPrediction(step, {"compute": step}, 500.0, samples_per_s)

    predictions = {"a": predicted(400), "b": predicted(360), "c": predicted(250)}
    searcher = PredictedFirst(["a", "b", "c"], predictions, 0.2, 1, "train_samples_per_s")
    assert searcher.suggest("t1") == {"key": "a"}
    # a measures at half its prediction (its step took twice as long, none of it input wait).
    for samples_per_s in (50.0, 200.0, 200.0):
        step_ms = 1000 * 32 / samples_per_s
        searcher.on_trial_result(
            "t1",
            {
                "train_samples_per_s": samples_per_s,
                "step_ms": step_ms,
                "step_data_wait_ms": 0.0,
            },  # fmt: skip
        )
    searcher.on_trial_complete("t1")
    # b, calibrated the same way, is expected at 180: within 20 % of a's 200, so it runs.
    assert searcher.suggest("t2") == {"key": "b"}
    searcher.on_trial_result("t2", {"train_samples_per_s": 10.0})
    searcher.on_trial_complete("t2", error=True)  # a crash measures nothing
    # c is expected at 125, 38 % below a's 200: not worth a trial.
    assert searcher.suggest("t3") == Searcher.FINISHED
    assert searcher.skipped == {"c": "predicted 38% slower than a measured"}


def test_tensor_parallel_replicas_pay_the_average_after_backward_less_what_fp16_saves():
    profile = {**PROFILE, "workers": 4, "levels": {**PROFILE["levels"], "4": _level(1.0, 10.0)}}

    def tp(*extra):
        return predict_config(profile, _cfg(
            "parallelism.strategy=tp", "parallelism.pp=1", "parallelism.workers=4",
            "parallelism.tp=2", "parallelism.dp=2", "training.batch_size=16", *extra,
        ))  # fmt: skip

    plain, fp16 = tp(), tp("parallelism.grad_compression=fp16")
    # Each tp worker averages its half of the 4 blocks' parameters and the whole ends, in fp32,
    # over a 1 ms + 1 ns/byte ring; fp16 halves the bytes, not the latency.
    saved = plain.parts["comm"] - fp16.parts["comm"]
    grad_bytes = 4 * (4 * 50_000 / 2 + 40_000)
    assert saved == pytest.approx(0.5 * grad_bytes * 1e-9)
    assert fp16.step_s < plain.step_s


def _wrapped_profile() -> dict:
    """PROFILE with the blocks as the sharded layouts of 2 workers ran them, and a parameter
    server's round trip, at the 2-worker level."""
    pair = {
        **PROFILE["levels"]["2"],
        "wrapped": {"tp2": _fit(20.0, 0.5), "fsdp2": _fit(8.0, 0.8)},
        "ps_push_s": 30 * MS,
    }
    return {**PROFILE, "levels": {**PROFILE["levels"], "2": pair}}


def test_sharded_layouts_are_predicted_from_their_own_profiled_block():
    profile = _wrapped_profile()
    ends = (0.5 + 0.25 * 32) * MS
    tp = predict_config(profile, _cfg(
        "parallelism.strategy=tp", "parallelism.pp=1", "parallelism.tp=2", "parallelism.dp=1",
    ))  # fmt: skip
    # The tp block's all-reduces are inside its profiled time: no activation all-reduces on top.
    optimizer = 1e-8 * (4 * 50_000 / 2 + 40_000)
    assert tp.parts["compute"] == pytest.approx(4 * (20.0 + 0.5 * 32) * MS + ends + optimizer)
    fsdp = predict_config(profile, _cfg(
        "parallelism.strategy=fsdp", "parallelism.pp=1", "parallelism.dp=2",
        "parallelism.workers=2",
    ))  # fmt: skip
    optimizer = 1e-8 * (4 * 50_000 + 40_000) / 2
    assert fsdp.parts["compute"] == pytest.approx(4 * (8.0 + 0.8 * 32) * MS + ends + optimizer)
    # Only the ends' gradients are reduce-scattered and gathered outside the blocks' time.
    plain = predict_config(PROFILE, fsdp_cfg := _cfg(
        "parallelism.strategy=fsdp", "parallelism.pp=1", "parallelism.dp=2",
        "parallelism.workers=2",
    ))  # fmt: skip
    assert predict_config(profile, fsdp_cfg).parts["comm"] < plain.parts["comm"]


def test_parameter_server_layouts_pay_the_profiled_round_trip():
    ssp = _cfg(
        "parallelism.strategy=ssp", "parallelism.pp=1", "parallelism.dp=2",
        "parallelism.workers=2",
    )  # fmt: skip
    assert predict_config(_wrapped_profile(), ssp).parts["comm"] == pytest.approx(30 * MS)
    # An older profile without it: two point-to-point transfers of the model's gradients.
    grad_bytes = 4 * (4 * 50_000 + 40_000)
    expected = 2 * (0.1 * MS + 0.3e-9 * grad_bytes)
    assert predict_config(PROFILE, ssp).parts["comm"] == pytest.approx(expected)


def test_a_wrapped_tensor_parallel_block_recomputed_pays_the_recomputed_forwards_all_reduces():
    tp = _cfg(
        "parallelism.strategy=tp", "parallelism.pp=1", "parallelism.tp=2", "parallelism.dp=1",
    )  # fmt: skip
    recompute = _cfg(
        "parallelism.strategy=tp", "parallelism.pp=1", "parallelism.tp=2", "parallelism.dp=1",
        "training.activation_checkpointing=true",
    )  # fmt: skip
    plain, again = (predict_config(_wrapped_profile(), c) for c in (tp, recompute))
    forward = (0.5 + 32 / 2 * 0.75 / 3) * MS  # the plain block's forward at half the rows
    all_reduce = 1 * MS + 1e-9 * 32 * 64 * 64 * 4  # one block's activations
    expected = 4 * (forward + 2 * all_reduce)
    assert again.parts["compute"] - plain.parts["compute"] == pytest.approx(expected)
