"""Context and sequence parallelism in both cost models: what a cp worker computes, holds and
sends round the ring (catalog and measured), the planner choosing cp for a sequence no device
holds, and lm_long under an activation budget."""

from __future__ import annotations

import pytest
import torch

from raylane.config import load_config
from raylane.models.losses import cross_entropy
from raylane.models.shape import DecoderShape
from raylane.plan.cost import Layout, Workload, predict
from raylane.plan.hardware import Cluster, ClusterSpec, load_cluster
from raylane.plan.measured import predict_config
from raylane.plan.search import config_overrides, plan
from raylane.profile.worker import _parts, _saved_bytes_per_row
from raylane.tune.candidates import enumerate_candidates
from raylane.tune.predicted import rank_with_profile
from raylane.tune.report import write_best_config
from raylane.tune.search import TrialOutcome
from raylane.tune.spec import TuneSpec

from .test_config import ROOT
from .test_plan import A100_4X8, GPT_1P3B
from .test_plan_measured import MS, PROFILE, _cfg

LM_LONG = ROOT / "configs" / "train" / "lm_long.yaml"


def _a100s(nodes: int, per_node: int) -> Cluster:
    spec = ClusterSpec(nodes=nodes, devices_per_node=per_node, accelerator="a100-80gb")
    return Cluster(spec, load_cluster(A100_4X8).device, basis="catalog")


def test_a_cp_worker_computes_and_holds_its_share_and_pays_the_ring_it_cannot_hide():
    # fp32 on two single-device nodes: the ring crosses nodes (25 GB/s), and at 512 tokens a
    # K/V transfer outlasts the attention step it overlaps.
    s, h, rows, layers = 512, 1024, 8, 4
    work = Workload(DecoderShape.gpt(256, s, h, layers, 8), rows)
    split = predict(work, Layout.of("ddp", dp=1, cp=2), _a100s(2, 1))
    whole = predict(work, Layout.of("ddp", dp=1), _a100s(1, 1))
    assert split.layout.describe() == "ddp dp1 cp2"
    assert split.parts["compute"] == pytest.approx(whole.parts["compute"] / 2)
    flops = 19.5e12 * 0.7
    transfer = 2 * rows * (s / 2) * h * 4 / 25e9 + 10e-6  # K and V, fp32, this worker's tokens
    step = 4 * rows * s * s * h / (2 * 2) / flops  # attention core, 1/cp of it per ring step
    assert transfer > step
    assert split.parts["cp_comm"] == pytest.approx(layers * 3 * (transfer - step))
    # The two cp workers average the gradients after backward: a 2-rank ring all-reduce.
    grads = work.shape.params_per_device() * 4
    assert split.parts["dp_comm"] == pytest.approx(grads / 25e9 + 2 * 10e-6)
    # Activations at 256 tokens: no saved scores, an fp32 log-sum-exp per head and token, and
    # one ring step's three fp32 256 x 256 blocks per head while a layer computes.
    t = s / 2
    per_layer = t * rows * h * 34 * 2 + 4 * rows * t * 8
    expected = per_layer * layers + t * rows * 256 * 8 + 3 * 4 * rows * 8 * t * t
    assert split.activation_bytes == pytest.approx(expected)


def test_a_sequence_no_device_holds_is_planned_with_context_parallelism(tmp_path):
    """262,144 tokens per row and a 50,257-token vocabulary: one row's fp32 logits and softmax
    alone are 105 GB, more than an 80 GB device unless tp splits the head; an unfused
    attention's scores (5·a·s²·b/t per layer, 343 GB at tp 8) fit no layout without cp. Both
    plans are the README's, to its printed digits: unfused, all 20 layouts without cp pruned and
    `ddp dp1 cp32` at 4.22 s per step and 53.3 GB per device, 2.13 s of it ring transfers;
    fused, 16 pruned and `fsdp dp4 tp8-sp` first, cp32 fifth."""
    shape = DecoderShape.gpt(50257, 262144, 1024, 4, 8)
    assert shape.context_length * shape.vocab_size * 8 > 80e9
    work = Workload(shape, 4, "bf16", fused_attention=False)
    result = plan(work, load_cluster(A100_4X8))
    unsplit = [layout for layout, _ in result.pruned if layout.cp == 1]
    assert len(unsplit) == 20 and all(p.layout.cp > 1 for p in result.ranked)
    best = result.ranked[0]
    assert best.layout.cp > 1 and best.fits
    assert best.layout.describe() == "ddp dp1 cp32"
    assert f"{best.step_s:.2f} s, {best.memory_bytes / 1e9:.1f} GB" == "4.22 s, 53.3 GB"
    assert f"{best.parts['cp_comm']:.2f}" == "2.13"
    # With the fused attention raylane runs (the default workload), sequence parallelism's
    # vocabulary-split head fits 4 tp8 layouts; cp32 ranks fifth at the same figures.
    fused = plan(Workload(shape, 4, "bf16"), load_cluster(A100_4X8))
    assert len([layout for layout, _ in fused.pruned if layout.cp == 1]) == 16
    lines = [f"{p.layout.describe()} {p.step_s:.2f} s, {p.memory_bytes / 1e9:.1f} GB"
             for p in fused.ranked[:5]]  # fmt: skip
    assert lines[0] == "fsdp dp4 tp8-sp 2.10 s, 19.3 GB"
    assert lines[4] == "ddp dp1 cp32 4.22 s, 53.3 GB"
    model = ["data.source=parquet", "model.num_classes=50257", "model.input_dim=262144",
             "model.d_model=1024", "model.n_heads=8", "model.n_layers=4"]  # fmt: skip
    cfg = load_config(GPT_1P3B, [*model, *config_overrides(best, work)])
    assert (cfg.parallelism.cp, cfg.parallelism.workers) == (best.layout.cp, 32)


def test_fused_attention_fits_the_same_sequence_without_context_parallelism():
    """raylane's SDPA keeps a log-sum-exp, never the scores: at tp 8 with sequence
    parallelism (the head split over the vocabulary) a row's 262,144 tokens fit one replica
    of 8 A100s, and such a layout is planned first."""
    work = Workload(DecoderShape.gpt(50257, 262144, 1024, 4, 8), 4, "bf16")
    result = plan(work, load_cluster(A100_4X8))
    best = result.ranked[0]
    assert best.layout.cp == 1 and best.layout.tp == 8 and best.layout.dims.sequence_parallel
    assert best.memory_bytes < 0.9 * 80e9


def test_the_measured_model_splits_a_cp_workers_compute_and_adds_the_exposed_ring():
    profile = {**PROFILE, "p2p": {"alpha_s": 1 * MS, "beta_s_per_byte": 0.3e-9}}
    rows, tokens, width, params = 16, 64 / 2, 64, 4 * 50_000 + 40_000
    cfg = _cfg("parallelism.strategy=ddp", "parallelism.pp=1", "parallelism.workers=2",
               "parallelism.cp=2", f"training.batch_size={rows}")  # fmt: skip
    predicted = predict_config(profile, cfg)
    block = (1.0 + 0.75 * rows / 2) * MS  # the 2-worker fit at rows / cp
    ends = (0.5 + 0.25 * rows / 2) * MS
    assert predicted.parts["compute"] == pytest.approx(4 * block + ends + 1e-8 * params)
    transfer = 1 * MS + 0.3e-9 * 2 * rows * tokens * width * 4
    step = (64 / 384) / (1 + 64 / 384) * block / 3 / 2  # attention core, forward, one ring step
    assert predicted.parts["ring"] == pytest.approx(4 * 3 * (transfer - step))
    assert predicted.samples_per_s == pytest.approx(rows / predicted.step_s)  # one replica
    saved = (300_000 / 2 * 4 * rows + 30_000 * rows / 2) / 2**20
    assert predicted.activation_mb == pytest.approx(saved)
    # Sequence parallelism: in every block, each LayerNorm's fp32 input and the inputs q, k, v
    # and the MLP's first linear keep on half the tokens; the model's end split in two.
    tp = ["parallelism.strategy=tp", "parallelism.pp=1", "parallelism.tp=2", "parallelism.dp=1"]
    plain = predict_config(PROFILE, _cfg(*tp))
    sequence = predict_config(PROFILE, _cfg(*tp, "parallelism.sequence_parallel=true"))
    blocks = 6 * 64 * 64 * 4 * (1 - 1 / 2) * 4 * 32  # 4 blocks, 32 rows of 64 tokens
    ends = 30_000 * 32 * (1 - 1 / 2)
    assert plain.activation_mb - sequence.activation_mb == pytest.approx((blocks + ends) / 2**20)
    # Reduce-scatter + all-gather move an all-reduce's bytes; backward's second gather of q,
    # k, v and the MLP's inputs is two all-reduces' more per block.
    regather = 4 * 2 * (1 * MS + 1e-9 * 32 * 64 * 64 * 4)
    assert sequence.step_s - plain.step_s == pytest.approx(regather)


def test_lm_long_outgrows_an_activation_budget_that_cp_2_fits(tmp_path):
    """lm_long's activations per row measured as the profile measures them (autograd's saved
    bytes, in-process): one worker at 2,048 positions and 4 rows holds about 97 MB (at 2 rows
    48.3 MB, where benchmarks/long_context.py measured 48.8 for the whole model), over a 64 MB
    activation budget; cp=2 holds half, and the winner's config is one `raylane train`
    accepts."""
    cfg = load_config(LM_LONG)
    m, (block, ends) = cfg.model, _parts(cfg)
    memory = {
        "block_activation_bytes_per_row": _saved_bytes_per_row(
            block, lambda n: torch.randn(n, m.input_dim, m.d_model, requires_grad=True)
        ),
        "ends_activation_bytes_per_row": _saved_bytes_per_row(
            lambda tokens: cross_entropy(ends(tokens), tokens),
            lambda n: torch.randint(0, m.num_classes, (n, m.input_dim)),
        ),
    }
    spec = TuneSpec.model_validate({
        "experiment": "long", "base": str(LM_LONG),
        "search": {"strategy": ["ddp"], "workers": [2], "cp": [1, 2], "batch_size": [4]},
        "constraints": {"cpus": 2.0, "cpus_per_worker": 0.5, "activation_mb_per_worker": 64},
    })  # fmt: skip
    candidates, _ = enumerate_candidates(spec)
    ranking = rank_with_profile(spec, candidates, {**PROFILE, **memory})
    one, split = (ranking.predictions[k] for k in ("ddp-w2-dp2xpp1-m1-b4",
                                                   "ddp-w2-dp1xpp1-cp2-m1-b4"))  # fmt: skip
    assert one.activation_mb > 64 > split.activation_mb
    assert split.activation_mb == pytest.approx(one.activation_mb / 2)
    assert [p.reason for p in ranking.pruned] == [
        f"predicted activations {one.activation_mb:.1f} MB over the 64.0 MB budget"
    ]
    [winner] = ranking.launch
    path = write_best_config(spec, TrialOutcome(winner, "ok", samples_per_s=1.0), tmp_path / "b")
    written = load_config(path)
    assert (written.parallelism.cp, written.parallelism.workers, written.model.input_dim) == (
        2, 2, 2048,
    )  # fmt: skip
