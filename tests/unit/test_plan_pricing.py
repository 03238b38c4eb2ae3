"""`raylane plan --objective cost`: the checkpoint interval against Young's and Daly's
formulas, spot against on-demand, cost ranking against time ranking, the catalog's prices."""

from __future__ import annotations

import math

import pytest

from raylane.config import load_config
from raylane.models.shape import DecoderShape
from raylane.plan.cost import Workload
from raylane.plan.hardware import Accelerator, Cluster, ClusterSpec, Pricing, load_cluster
from raylane.plan.pricing import (
    CostTerms,
    checkpoint_seconds,
    expected_seconds,
    optimal_interval_s,
    price_layout,
    young_interval_s,
)
from raylane.plan.search import epoch_tokens_for, plan, plan_by_cost, workload_for

from .test_plan import A100_4X8, GPT_1P3B, _raylane

PRICES = Pricing(
    on_demand_usd_per_hour=4.0,
    spot_usd_per_hour=1.5,
    spot_interruptions_per_node_hour=0.05,
    source="test figures",
)


def test_young_interval_is_the_hand_computed_value():
    # delta = 30 s, lambda = 0.5 per hour (M = 7200 s): sqrt(2 * 30 * 7200) = sqrt(432000).
    assert young_interval_s(30.0, 0.5) == pytest.approx(657.267069, rel=1e-6)


def test_the_optimum_is_near_young_when_checkpoints_are_cheap_and_minimises_expected_time():
    delta, rate = 10.0, 0.1  # a 10 s checkpoint, a preemption every 10 hours
    young, optimum = young_interval_s(delta, rate), optimal_interval_s(delta, rate)
    assert delta < 0.02 * optimum
    assert optimum == pytest.approx(young, rel=0.01)
    # Daly (FGCS 2006)'s higher-order estimate:
    # sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + delta / 18M] - delta
    mean = 3600 / rate
    daly = math.sqrt(2 * delta * mean) * (
        1 + math.sqrt(delta / (2 * mean)) / 3 + delta / (2 * mean) / 9
    ) - delta  # fmt: skip
    assert optimum == pytest.approx(daly, rel=1e-4)
    intervals = (0.8 * optimum, optimum, 1.25 * optimum)
    at = [expected_seconds(3600.0, t, delta, 60.0, rate) for t in intervals]
    assert at[1] < at[0] and at[1] < at[2]
    # To first order the overhead is delta/tau + lambda (R + tau/2).
    first_order = delta / optimum + rate / 3600 * (60.0 + optimum / 2)
    assert at[1] / 3600.0 - 1 == pytest.approx(first_order, rel=0.02)


def test_expensive_checkpoints_move_the_optimum_below_young():
    assert optimal_interval_s(300.0, 6.0) < 0.8 * young_interval_s(300.0, 6.0)


def test_spot_is_chosen_when_its_discount_outweighs_the_preemptions():
    terms = CostTerms(epoch_tokens=1e9, checkpoint_s=20.0, restart_s=300.0)
    cost = price_layout(2.0, 1e6, devices=16, nodes=2, pricing=PRICES, terms=terms)
    assert cost.best is cost.spot and cost.rate_per_hour == pytest.approx(0.1)
    assert cost.on_demand.hours == pytest.approx(1000 * 2.0 / 3600)
    assert cost.spot.hours > cost.on_demand.hours  # the preemptions' overhead
    assert cost.saving == pytest.approx(1 - cost.spot.usd / cost.on_demand.usd)
    assert cost.saving > 0.55
    assert cost.checkpoint_steps == round(cost.optimum_s / 2.0)
    assert cost.usd_per_million_tokens(cost.spot) == pytest.approx(cost.spot.usd / 1000)


def test_on_demand_is_chosen_when_preemptions_come_too_often():
    often = PRICES.model_copy(update={"spot_interruptions_per_node_hour": 6.0})
    terms = CostTerms(epoch_tokens=1e9, checkpoint_s=60.0, restart_s=600.0)
    cost = price_layout(2.0, 1e6, devices=32, nodes=4, pricing=often, terms=terms)
    assert cost.best is cost.on_demand and cost.spot.usd > cost.on_demand.usd


def test_spot_without_preemptions_needs_no_checkpoints():
    never = PRICES.model_copy(update={"spot_interruptions_per_node_hour": 0.0})
    cost = price_layout(2.0, 1e6, 8, 1, never, CostTerms(1e9, 20.0))
    assert cost.checkpoint_steps is None and cost.spot.hours == cost.on_demand.hours
    assert cost.saving == pytest.approx(1 - 1.5 / 4.0)


def _two_node_cluster(inter_node_gbps: float, pricing: Pricing | None = PRICES) -> Cluster:
    device = Accelerator(
        peak_flops={"fp32": 20e12, "tf32": 150e12, "bf16": 300e12},
        memory_gb=80,
        intra_node_gbps=300,
        inter_node_gbps=inter_node_gbps,
        pricing=pricing,
    )
    return Cluster(ClusterSpec(nodes=2, devices_per_node=8, accelerator="x"), device, "catalog")


def test_the_cheapest_layout_can_be_slower_on_fewer_devices():
    """Between nodes the link is slow: two nodes step faster than one, but not twice as fast,
    so one node costs less per epoch."""
    work = Workload(DecoderShape.gpt(256, 1024, 1024, 8, 8), 64, "bf16")
    cluster = _two_node_cluster(inter_node_gbps=10)
    fastest = plan(work, cluster).ranked[0]
    by_cost = plan_by_cost(work, cluster, CostTerms(1e9, 10.0))
    cheapest = by_cost.ranked[0]
    assert fastest.layout.workers == 16 and cheapest.layout.workers == 8
    assert cheapest.step_s > fastest.step_s
    assert by_cost.costs[cheapest.layout].best.usd < by_cost.costs[fastest.layout].best.usd
    costs = [by_cost.costs[p.layout].best.usd for p in by_cost.ranked]
    assert costs == sorted(costs)


def test_a_catalog_without_prices_cannot_plan_by_cost():
    work = Workload(DecoderShape.gpt(256, 1024, 1024, 8, 8), 64, "bf16")
    with pytest.raises(ValueError, match="x has no pricing in the hardware catalog"):
        plan_by_cost(work, _two_node_cluster(10, pricing=None), CostTerms(1e9, 10.0))


def test_an_epoch_is_read_from_the_config_where_raylane_knows_its_size():
    cfg = load_config(GPT_1P3B)
    work = workload_for(cfg, 512, "bf16")
    tokens, source = epoch_tokens_for(cfg, work)
    assert tokens == pytest.approx(cfg.data.max_bytes * 0.9) and "data.max_bytes" in source
    capped = load_config(GPT_1P3B, ["training.steps_per_epoch=10"])
    assert epoch_tokens_for(capped, work)[0] == 10 * 512 * 2048
    parquet = load_config(GPT_1P3B, ["data.source=parquet"])
    with pytest.raises(ValueError, match="needs --epoch-tokens"):
        epoch_tokens_for(parquet, work)


def test_a_checkpoint_is_fp32_weights_and_adam_state():
    # 16 bytes per parameter: weights and Adam's moments, then the assembled weights
    assert checkpoint_seconds(1e9, gbps=2.0) == pytest.approx(8.0)


_ENTRY = (
    "x1:\n  peak_flops: {fp32: 1e12}\n  memory_gb: 8\n  intra_node_gbps: 1\n  inter_node_gbps: 1\n"
)


@pytest.mark.parametrize(
    ("prices", "expected"),
    [
        ("0, spot_usd_per_hour: 0.5, spot_interruptions_per_node_hour: 0.1",
         "x1.pricing.on_demand_usd_per_hour: Input should be greater than 0"),
        ("1, spot_usd_per_hour: 2, spot_interruptions_per_node_hour: 0.1",
         "x1.pricing: spot_usd_per_hour (2) is above on_demand_usd_per_hour (1)"),
        ("1, spot_usd_per_hour: 0.5, spot_interruptions_per_node_hour: -1",
         "x1.pricing.spot_interruptions_per_node_hour: Input should be greater than or equal"),
    ],
)  # fmt: skip
def test_bad_prices_are_one_line_naming_the_field(tmp_path, prices, expected):
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(_ENTRY + f"  pricing: {{on_demand_usd_per_hour: {prices}, source: mine}}\n")
    spec = tmp_path / "c.yaml"
    spec.write_text("nodes: 1\ndevices_per_node: 1\naccelerator: x1\n")
    with pytest.raises(ValueError) as raised:
        load_cluster(spec, catalog)
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_the_catalog_prices_every_accelerator_and_names_its_source():
    cluster = load_cluster(A100_4X8)
    assert cluster.device.pricing is not None
    assert "edit" in cluster.device.pricing.source


def test_plan_by_cost_prints_the_recommendation_and_writes_it(tmp_path):
    out = tmp_path / "plan.yaml"
    run = _raylane(
        "plan", "--model", str(GPT_1P3B), "--cluster", str(A100_4X8), "--global-batch", "512",
        "--objective", "cost", "--epoch-tokens", "26e9", "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "recommended: spot capacity for" in run.stdout
    assert "Young's interval" in run.stdout and "source: AWS p4de" in run.stdout
    assert "basis: catalog figures for a100-80gb" in run.stdout
    header = out.read_text().splitlines()[:3]
    assert "--objective cost: spot capacity" in header[1]
    assert load_config(out).parallelism.use_gpu


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--objective", "money"], "--objective must be time or cost, not 'money'"),
        (["--restart-s", "10"], "apply to --objective cost"),
        (["--objective", "cost", "--checkpoint-s", "0"], "--checkpoint-s must be above 0"),
    ],
)
def test_bad_cost_options_are_one_line(args, expected):
    run = _raylane("plan", "--model", str(GPT_1P3B), "--cluster", str(A100_4X8), *args)
    assert run.returncode == 2
    assert expected in run.stderr or expected in run.stdout
    assert len([line for line in (run.stderr + run.stdout).splitlines() if line.strip()]) == 1
