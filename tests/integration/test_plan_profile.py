"""The profile job on the session cluster: it measures a GPT block and the worker group's
links, lands in MLflow, and is reused while model and cluster are unchanged."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from mlflow.tracking import MlflowClient

from raylane.models.families import shape_of
from raylane.plan.fits import block_train_flops, compute_fit
from raylane.profile.job import load_or_measure, measured_cluster, profile_key
from raylane.profile.worker import ROWS


def test_profile_measures_once_then_is_reused(lm_profile, workspace):
    # The session's first call for this key: `lm_profile` ran the profile job.
    cfg, found, run_id = lm_profile.config, lm_profile.profile, lm_profile.run_id
    assert not lm_profile.reused and found["workers"] == 2 and set(found["levels"]) == {"1", "2"}
    for level in found["levels"].values():
        # Each part timed at every row count, and its line the least-squares fit of those times
        # (the seconds themselves are the machine's: what holds under any load is the fit).
        for part in ("block", "block_forward", "ends"):
            timed = {int(rows): seconds for rows, seconds in level[f"{part}_s"].items()}
            assert sorted(timed) == list(ROWS) and min(timed.values()) > 0, (part, timed)
            assert level[part] == asdict(compute_fit(timed)), part
        assert level["optimizer_s_per_param"] > 0
    pair = found["levels"]["2"]
    assert pair["all_reduce"]["beta_s_per_byte"] > 0 and found["p2p"] is not None
    assert pair["ddp_wait"]["fixed_s"] + pair["ddp_wait"]["per_row_s"] > 0
    assert pair["schedules"]["gpipe"]["per_row_s"] > 0  # each micro-batch costs the schedule
    assert "all_reduce" not in found["levels"]["1"]
    # The sharded layouts' blocks as `parallelize` wraps them, on both workers at once (how
    # much a wrapped block costs against the plain one is the machine's: benchmarks/).
    # And the block under ring attention (its sequence cuts into 2 x 2 chunks).
    assert cfg.model.input_dim % 4 == 0
    assert set(pair["wrapped"]) == {"tp2", "fsdp2", "cp2"} and "wrapped" not in found["levels"]["1"]
    for name, wrapped in pair["wrapped"].items():
        assert set(wrapped) == {"fixed_s", "per_row_s", "optimizer_s"}, name
        assert min(wrapped["fixed_s"], wrapped["per_row_s"]) >= 0, name  # clamped fits
        assert wrapped["fixed_s"] + max(ROWS) * wrapped["per_row_s"] > 0, name
        assert wrapped["optimizer_s"] > 0, name
    # The parameter server's round trip, alone and with both workers pushing.
    assert found["levels"]["1"]["ps_push_s"] > 0 and pair["ps_push_s"] > 0
    # The headline figure: a block's training FLOPs at the most rows, over the fit's seconds
    # there, at the largest concurrency (both workers at once).
    width = cfg.model.d_model
    pair_s = pair["block"]["fixed_s"] + max(ROWS) * pair["block"]["per_row_s"]
    flops = block_train_flops(max(ROWS), shape_of(cfg.model))
    assert found["block_flops_per_s"] == pytest.approx(flops / pair_s, rel=1e-12)
    assert found["block_params"] == 12 * width * width + 13 * width  # 4 linears, 2 norms
    # A block saves more per row than the ends (logits) do; both are positive.
    assert found["block_activation_bytes_per_row"] > found["ends_activation_bytes_per_row"] > 0
    assert 100 < found["baseline_rss_mb"] < 4000

    run = MlflowClient(tracking_uri=workspace.tracking_uri).get_run(run_id)
    assert run.data.metrics["block_flops_per_s"] == found["block_flops_per_s"]
    again, again_id, reused_again = load_or_measure(cfg, workspace.tracking_uri, concurrency=[2, 1])
    assert reused_again and again_id == run_id and again == found
    # Other worker counts are another profile.
    assert profile_key(cfg, [1, 2]) != profile_key(cfg, [2])

    cluster = measured_cluster(found, memory_gb=8)
    assert cluster.basis == "measured" and cluster.devices == 2
    assert cluster.device.peak_flops["fp32"] == found["block_flops_per_s"]
