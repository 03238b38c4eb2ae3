"""`raylane plan`: the cost model against a published training throughput, its parts' logic,
and the command on a cluster that is not here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raylane.config import load_config
from raylane.plan.cost import Layout, Workload, predict
from raylane.plan.hardware import Cluster, ClusterSpec, load_cluster
from raylane.plan.memory import GPTShape
from raylane.plan.search import plan, workload_for

from .test_config import ROOT

GPT_1P3B = ROOT / "configs" / "plan" / "gpt_1p3b.yaml"
A100_4X8 = ROOT / "configs" / "clusters" / "a100_4x8.yaml"


def _a100_cluster(nodes: int) -> Cluster:
    base = load_cluster(A100_4X8)
    spec = ClusterSpec(nodes=nodes, devices_per_node=8, accelerator="a100-80gb")
    return Cluster(spec, base.device, basis="catalog")


def test_megatron_trillion_parameter_throughput_is_predicted_within_a_quarter():
    """Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM" (SC 2021), Table 1: a 1T-parameter GPT (hidden 25600, 128 layers, 160 heads,
    sequence 2048, vocabulary 51200), tensor parallel 8 x pipeline 64 x data parallel 6 on 3072
    A100s, batch 3072, fp16, full activation recomputation: 163 TFLOP/s per GPU. Predicted
    from catalog figures with matmuls at 70 % of peak (and micro-batches of one sequence)."""
    work = Workload(GPTShape(51200, 2048, 25600, 128), 160, 3072, "bf16", head_split_by_tp=True)
    assert work.shape.total() == pytest.approx(1008e9, rel=0.01)
    layout = Layout.of("hybrid", dp=6, tp=8, pp=64, microbatches=512, activation_checkpointing=True)
    predicted = predict(work, layout, _a100_cluster(nodes=384))
    assert predicted.flops_per_device == pytest.approx(163e12, rel=0.25)
    assert predicted.fits  # it ran on 80 GB devices


def test_the_parts_respond_to_the_layout_as_they_should():
    cfg = load_config(GPT_1P3B)
    work = workload_for(cfg, 512, "bf16")
    cluster = _a100_cluster(nodes=4)
    few = predict(work, Layout.of("hybrid", dp=16, pp=2, microbatches=2), cluster)
    many = predict(work, Layout.of("hybrid", dp=16, pp=2, microbatches=16), cluster)
    assert few.parts["bubble"] == pytest.approx(few.parts["compute"] / 2)  # (p - 1) / m
    assert many.parts["bubble"] < few.parts["bubble"]
    assert many.activation_bytes < few.activation_bytes  # smaller micro-batches
    tp2 = predict(work, Layout.of("tp", dp=16, tp=2), cluster)
    tp8 = predict(work, Layout.of("tp", dp=4, tp=8), cluster)
    assert tp8.parts["tp_comm"] > tp2.parts["tp_comm"] > 0
    ddp = predict(work, Layout.of("ddp", dp=32), cluster)
    fsdp = predict(work, Layout.of("fsdp", dp=32), cluster)
    assert fsdp.state.total == pytest.approx(ddp.state.total / 32)
    checkpointed = predict(work, Layout.of("ddp", dp=32, activation_checkpointing=True), cluster)
    assert checkpointed.activation_bytes < ddp.activation_bytes
    assert checkpointed.parts["compute"] > ddp.parts["compute"]  # the recomputed forward


def test_plan_ranks_only_layouts_that_fit_and_says_why_others_do_not():
    work = workload_for(load_config(GPT_1P3B), 512, "fp32")
    result = plan(work, load_cluster(A100_4X8))
    assert result.ranked and result.pruned
    assert all(p.fits and p.layout.workers == 32 for p in result.ranked)
    steps = [p.step_s for p in result.ranked]
    assert steps == sorted(steps)
    assert all("GB per device, has 80 GB" in reason for _, reason in result.pruned)


def _raylane(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raylane.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )


def test_plan_command_prints_the_plan_and_writes_a_runnable_config(tmp_path):
    out = tmp_path / "plan.yaml"
    run = _raylane(
        "plan", "--model", str(GPT_1P3B), "--cluster", str(A100_4X8), "--global-batch", "512",
        "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "basis: catalog figures for a100-80gb" in run.stdout
    assert "pruned" in run.stdout and f"config: {out}" in run.stdout
    cfg = load_config(out)
    assert cfg.parallelism.workers == 32 and cfg.parallelism.use_gpu
    assert cfg.model.d_model == 2048  # the planned model, unchanged


@pytest.mark.parametrize(
    ("cluster_yaml", "expected"),
    [
        ("nodes: 0\ndevices_per_node: 8\naccelerator: a100-80gb\n", "nodes: Input should be"),
        ("nodes: 2\ndevices_per_node: 8\naccelerator: tpu-v9\n", "accelerator 'tpu-v9' is not in"),
        ("nodes: 2\ndevices_per_node: 8\n", "accelerator: Field required"),
    ],
)
def test_a_bad_cluster_spec_is_one_line_naming_the_field(tmp_path, cluster_yaml, expected):
    spec = tmp_path / "cluster.yaml"
    spec.write_text(cluster_yaml)
    run = _raylane("plan", "--model", str(GPT_1P3B), "--cluster", str(spec))
    assert run.returncode == 2
    assert expected in run.stderr and str(spec) in run.stderr
    assert len([line for line in run.stderr.splitlines() if line.strip()]) == 1


def test_a_model_nothing_fits_is_refused_with_the_reason(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text("nodes: 1\ndevices_per_node: 1\naccelerator: l4-24gb\n")
    run = _raylane("plan", "--model", str(GPT_1P3B), "--cluster", str(spec), "--global-batch", "64")
    assert run.returncode == 1
    assert "no layout of 1.31 B parameters fits 1 x l4-24gb" in run.stderr


def test_an_unknown_catalog_field_is_refused(tmp_path):
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("x1:\n  peak_flops: {fp32: 1e12}\n  memory_gb: 8\n  intra_node_gbps: 1\n")
    spec = tmp_path / "c.yaml"
    spec.write_text("nodes: 1\ndevices_per_node: 1\naccelerator: x1\n")
    with pytest.raises(ValueError, match="inter_node_gbps: Field required"):
        load_cluster(spec, catalog)


def test_sequence_parallelism_divides_the_norm_residual_and_logit_activations_by_tp():
    from dataclasses import replace

    from raylane.plan.cost import _activation_bytes

    work = Workload(GPTShape(256, 1024, 512, 8), 8, 32)
    plain = Layout.of("tp", dp=1, tp=4)
    sequence = Layout(replace(plain.dims, sequence_parallel=True))
    s, h, a, t, b = work.seq, work.shape.d_model, work.n_heads, 4, 1.0
    assert (s, h) == (1024, 512)
    per_layer = {k: s * b * h * (k + 24 / t + 5 * a * s / (h * t)) * work.value_bytes / 2
                 for k in (10, 10 / t)}  # fmt: skip
    logits = s * b * 256 * 4 * 2 * (1 - 1 / t)  # the head split over the vocabulary
    saved = (per_layer[10] - per_layer[10 / t]) * work.shape.n_layers + logits
    assert _activation_bytes(work, plain, b) - _activation_bytes(work, sequence, b) == (
        pytest.approx(saved)
    )
    assert sequence.describe() == "tp dp1 tp4-sp"
