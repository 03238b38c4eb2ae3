"""The profile job on the session cluster: it measures a GPT block and the worker group's
links, lands in MLflow, and is reused while model and cluster are unchanged."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from raylane.profile.job import load_or_measure, measured_cluster, profile_key


def test_profile_measures_once_then_is_reused(lm_profile, workspace):
    # The session's first call for this key: `lm_profile` ran the profile job.
    cfg, found, run_id = lm_profile.config, lm_profile.profile, lm_profile.run_id
    assert not lm_profile.reused and found["workers"] == 2 and set(found["levels"]) == {"1", "2"}
    for level in found["levels"].values():
        assert level["block_s"]["32"] > level["block_s"]["2"] > 0  # more rows take longer
        assert level["block"]["per_row_s"] > 0 and level["optimizer_s_per_param"] > 0
    pair = found["levels"]["2"]
    assert pair["all_reduce"]["beta_s_per_byte"] > 0 and found["p2p"] is not None
    assert pair["ddp_wait"]["fixed_s"] + pair["ddp_wait"]["per_row_s"] > 0
    assert pair["schedules"]["gpipe"]["per_row_s"] > 0  # each micro-batch costs the schedule
    assert "all_reduce" not in found["levels"]["1"]
    # The sharded layouts' blocks as `parallelize` wraps them, on both workers at once: tensor
    # parallel pays its all-reduces inside the block, more than the plain block's half rows.
    tp2 = pair["wrapped"]["tp2"]
    assert set(pair["wrapped"]) == {"tp2", "fsdp2"} and "wrapped" not in found["levels"]["1"]
    half_rows = pair["block"]["fixed_s"] + 16 * pair["block"]["per_row_s"]
    assert tp2["fixed_s"] + 32 * tp2["per_row_s"] > half_rows
    # The parameter server's round trip, alone and with both workers pushing.
    assert found["levels"]["1"]["ps_push_s"] > 0 and pair["ps_push_s"] > 0
    assert found["block_flops_per_s"] > 1e8
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
