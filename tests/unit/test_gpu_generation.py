"""Generation and serving on a device, checked where CI runs: on the CPU.

The engine builds every tensor on its model's device, chooses a whole batch's tokens there and
reads them back once per step; prompts admitted together are prefilled in one forward; weights,
KV cache and adapter stacks follow the model's dtype (bf16) and int8 weights; replicas ask Ray
for GPUs. On the CPU the outputs must be what they were: the uncached reference's and
`transformers`' tokens. The `gpu` tests run the same paths on CUDA where one is present.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from raylane.models.gpt import GPT
from raylane.models.kv_cache import KVCache
from raylane.serving.generation.engine import GenerationEngine, generate_without_cache
from raylane.serving.generation.next_token import Sampling
from raylane.serving.generation.placement import place_model, serving_device

CONTEXT = 64
GREEDY = Sampling(max_tokens=20, temperature=0)
SAMPLED = [
    Sampling(max_tokens=18, temperature=0.9, seed=1),
    Sampling(max_tokens=14, temperature=0.8, top_k=40, seed=2),
    Sampling(max_tokens=16, temperature=1.1, top_p=0.9, seed=3),
]


def _model(seed: int = 0, d_model: int = 32, n_layers: int = 2) -> GPT:
    torch.manual_seed(seed)
    return GPT(256, CONTEXT, d_model, 4, n_layers).eval()


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: GenerationEngine, requests) -> list[list[int]]:
    sequences = [engine.add(prompt, params) for prompt, params in requests]
    while engine.busy:
        engine.step()
    return [s.output for s in sequences]


def test_a_batch_of_greedy_and_seeded_requests_draws_what_each_draws_alone():
    """Tokens are chosen for the whole batch on the device, sampled rows from their own
    generators: each request gets the tokens of the uncached reference with its seed."""
    model = _model()
    requests = [(_prompt(1, 5), GREEDY), *[(_prompt(i, 3 + 4 * i), p) for i, p in
                                           enumerate(SAMPLED, start=2)]]  # fmt: skip
    outputs = _run(GenerationEngine(model, max_num_seqs=3), requests)
    expected = [generate_without_cache(model, prompt, p).output for prompt, p in requests]
    assert outputs == expected
    assert len({tuple(o) for o in outputs}) == len(requests)


def test_prompts_admitted_together_are_prefilled_in_one_forward_as_transformers_decodes_them():
    from raylane.serving.generation.hf_peer import hf_greedy, to_hf_gpt2

    model = _model(1)
    prompts = [_prompt(seed, length) for seed, length in ((4, 1), (5, 9), (6, 3), (7, 17))]
    engine = GenerationEngine(model, max_num_seqs=4)
    sequences = [engine.add(p, GREEDY) for p in prompts]
    engine.step()
    assert engine.forwards == 1 and all(len(s.output) == 1 for s in sequences)
    while engine.busy:
        engine.step()
    peer = to_hf_gpt2(model)
    assert [s.output for s in sequences] == [hf_greedy(peer, p, GREEDY.max_tokens) for p in prompts]


class _HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value back to the host (a device sync on a GPU)."""

    READS = {
        torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__int__,
        torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__,
    }  # fmt: skip

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def _reads_per_step(engine: GenerationEngine, requests, adapters=()):
    """`(host reads seen per step, outputs)` of running `requests` to their end."""
    rows = adapters or [0] * len(requests)
    pairs = zip(requests, rows, strict=True)
    sequences = [engine.add(prompt, params, row) for (prompt, params), row in pairs]
    reads = set()
    while engine.busy:
        with _HostReads() as counter:
            engine.step()
        reads.add(counter.count)
    return reads, [s.output for s in sequences]


def test_a_greedy_step_reads_the_device_once_whatever_it_runs():
    """One host read per step for decode plus prefill, prompt-lookup and draft speculation
    (proposals and checks read back together) and sequences of different adapters, not one
    per sequence and token; the outputs are the plain model's and the merged adapters'."""
    from tests.unit.test_adapters import _base, _merged, _scaled, _trained_adapter

    model = _model()
    greedy = [(_prompt(i, 4 + i) * 2, GREEDY) for i in range(5)]
    plain = [generate_without_cache(model, p, params).output for p, params in greedy]
    draft = _model(5, d_model=16, n_layers=1)
    for options in ({}, {"speculate": 3}, {"speculate": 3, "draft": draft}):
        engine = GenerationEngine(model, max_num_seqs=3, **options)
        assert _reads_per_step(engine, greedy) == ({1}, plain), options
    engine = GenerationEngine(_base(), max_num_seqs=3, max_adapters=2)
    adapters = {key: _trained_adapter(seed) for key, seed in (("a/1", 1), ("a/2", 2))}
    for key, adapter in adapters.items():
        engine.adapters.add(key, *_scaled(adapter))
    keys = ["a/1", "a/2", "a/1", None]
    rows = [engine.adapters.acquire(key) if key else 0 for key in keys]
    short = [(_prompt(i, 5), Sampling(max_tokens=8, temperature=0)) for i in range(4)]
    reads, outputs = _reads_per_step(engine, short, rows)
    models = [_merged(*adapters[key]) if key else _base() for key in keys]
    assert reads == {1}
    pairs = zip(models, short, strict=True)
    assert outputs == [generate_without_cache(m, p, q).output for m, (p, q) in pairs]


def test_the_fixed_shape_decode_step_decodes_the_dynamic_steps_greedy_tokens():
    """Every slot over the whole buffer under a mask (what a CUDA graph captures), eager on
    the CPU: the same tokens as the dynamic step with requests coming and going, one device
    read per step, and a step with an adapter in its batch taking the dynamic path."""
    from tests.unit.test_adapters import _base, _scaled, _trained_adapter

    model = _model(3)
    requests = [(_prompt(i, 2 + 5 * i), Sampling(max_tokens=9 + 5 * i, temperature=0))
                for i in range(6)]  # fmt: skip
    dynamic = _run(GenerationEngine(model, max_num_seqs=3), requests)
    assert _run(GenerationEngine(model, max_num_seqs=3, decode="static"), requests) == dynamic
    assert _reads_per_step(GenerationEngine(model, 3, decode="static"), requests)[0] == {1}

    def adapted(decode: str) -> list[list[int]]:
        engine = GenerationEngine(_base(), 2, max_adapters=1, decode=decode)
        engine.adapters.add("a/1", *_scaled(_trained_adapter(1)))
        prompt = list(b"def f(x):")
        long, short = (Sampling(max_tokens=n, temperature=0) for n in (20, 12))
        plain = engine.add(prompt, long)  # alone for its first steps, then beside the adapter
        engine.step()
        engine.step()
        with_adapter = engine.add(prompt, short, engine.adapters.acquire("a/1"))
        while engine.busy:
            engine.step()
        return [plain.output, with_adapter.output]

    assert adapted("static") == adapted("dynamic")
    with pytest.raises(ValueError, match="decode 'static' serves plain decoding"):
        GenerationEngine(model, 1, speculate=2, decode="static")
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        GenerationEngine(model, 1, decode="cuda_graph")


def test_bf16_weights_cache_and_adapter_stacks_take_the_models_dtype():
    from tests.unit.test_adapters import _scaled, _trained_adapter

    model = place_model(GPT(256, 32, 32, 2, 2), "cpu", "bf16")
    engine = GenerationEngine(model, max_num_seqs=2, speculate=2, max_adapters=1)
    assert {k.dtype for k in engine.cache.keys + engine.cache.values} == {torch.bfloat16}
    engine.adapters.add("a/1", *_scaled(_trained_adapter(1)))  # fp32 host tensors
    row = engine.adapters.acquire("a/1")
    layer = next(iter(engine.adapters.layers.values()))
    assert layer.lora_a.dtype == layer.lora_b.dtype == layer.scale.dtype == torch.bfloat16
    sequence = engine.add(_prompt(1, 6), Sampling(max_tokens=9, temperature=0.8, seed=4), row)
    while engine.busy:
        engine.step()
    assert len(sequence.output) == 9
    tokens = torch.tensor([_prompt(2, 12)], device="cpu")
    with torch.no_grad():
        cached = model.extend(tokens, KVCache.for_model(model, 1), [0])
        whole = model(tokens)
    assert cached.dtype == torch.bfloat16
    torch.testing.assert_close(cached, whole, atol=0.1, rtol=0.05)


def test_int8_weights_decode_on_their_device_in_either_dtype():
    model = _model(2)
    for dtype in ("fp32", "bf16"):
        quantized = place_model(copy.deepcopy(model), "cpu", dtype, "int8")
        assert type(quantized.blocks["0"].attn.q.weight).__name__ == "Int8Tensor"
        engine = GenerationEngine(quantized, max_num_seqs=2)
        outputs = _run(engine, [(_prompt(3, 6), GREEDY), (_prompt(4, 2), SAMPLED[0])])
        assert [len(o) for o in outputs] == [GREEDY.max_tokens, SAMPLED[0].max_tokens]
        if dtype == "fp32":  # bf16 rounding may turn a near tie: equality is fp32's claim
            assert outputs[0] == generate_without_cache(quantized, _prompt(3, 6), GREEDY).output


def test_a_registered_export_moves_with_the_devices_its_graph_was_traced_with():
    """MLflow loads a pt2 model where it was exported and cannot move it; the GPT's graph
    holds `arange(..., device=cpu)`. Moved to the meta device, nothing stays on the host."""
    from raylane.serving.inference.predictor import move_exported

    model, tokens = _model(), torch.randint(0, 256, (2, 16), device="cpu")
    batch = torch.export.Dim("batch")
    module = torch.export.export(model, (tokens,), dynamic_shapes=({0: batch},)).module()
    move_exported(module, "meta")
    assert {p.device.type for p in module.parameters()} == {"meta"}
    devices = {str(n.kwargs["device"]) for n in module.graph.nodes if "device" in n.kwargs}
    assert devices == {"meta"}
    assert module(tokens.to("meta")).device.type == "meta"


def test_replicas_ask_ray_for_gpus_and_serve_in_the_configured_dtype():
    from raylane.config import ConfigError, load_config
    from raylane.serving.app import build_app
    from tests.readme_blocks import ROOT

    lm = ROOT / "configs" / "train" / "lm_serve.yaml"
    settings = ["serving.replica_gpus=0.5", "serving.dtype=bf16"]
    cfg = load_config(lm, [*settings, "serving.generation.max_model_len=2048"])
    deployment = build_app(cfg, "sqlite:///unused.db", 3, None)._bound_deployment
    assert deployment.ray_actor_options["num_gpus"] == 0.5
    assert deployment.init_args[0].replica_gpus == 0.5
    assert deployment.init_args[0].version == 3
    assert deployment.init_kwargs == {"dtype": "bf16", "cuda_graphs": False, "max_model_len": 2048}
    digits = ROOT / "configs" / "train" / "digits_ddp.yaml"
    deployment = build_app(load_config(digits, []), "sqlite:///unused.db", 1, None)
    assert deployment._bound_deployment.ray_actor_options["num_gpus"] == 0
    assert deployment._bound_deployment.init_args[0].replica_gpus == 0
    with pytest.raises(ConfigError, match="dtype 'bf16' applies to api 'generate'"):
        load_config(digits, ["serving.dtype=bf16"])
    with pytest.raises(ConfigError, match="serving.replica_gpus"):
        load_config(digits, ["serving.replica_gpus=-1"])
    with pytest.raises(ConfigError, match="replica_gpus 1.5: Ray shares a GPU in fractions"):
        load_config(lm, ["serving.replica_gpus=1.5"])
    assert load_config(lm, ["serving.replica_gpus=2"]).serving.replica_gpus == 2
    with pytest.raises(ConfigError, match="cuda_graphs needs replica_gpus > 0"):
        load_config(lm, ["serving.cuda_graphs=true"])
    graphs = ["serving.cuda_graphs=true", "serving.replica_gpus=1"]
    with pytest.raises(ConfigError, match="it needs generation.speculate 0 \\(not 2\\)"):
        load_config(lm, [*graphs, "serving.generation.speculate=2"])
    deployment = build_app(load_config(lm, graphs), "sqlite:///unused.db", 3, None)
    assert deployment._bound_deployment.init_kwargs["cuda_graphs"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_replica_given_gpus_without_cuda_says_so_in_one_line():
    assert serving_device(0) == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"serving.replica_gpus is 0.5 but torch .* no CUDA"):
        serving_device(0.5)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@CUDA
def test_on_cuda_the_engine_decodes_what_the_cpu_and_transformers_decode():
    from raylane.serving.generation.hf_peer import hf_greedy, to_hf_gpt2
    from tests.unit.test_adapters import _scaled, _trained_adapter

    cpu = _model()
    gpu = place_model(copy.deepcopy(cpu), "cuda")
    prompts = [_prompt(i, 3 + 5 * i) for i in range(4)]
    engine = GenerationEngine(gpu, max_num_seqs=4)
    outputs = _run(engine, [(p, GREEDY) for p in prompts])
    assert outputs == _run(GenerationEngine(cpu, 4), [(p, GREEDY) for p in prompts])
    peer = to_hf_gpt2(gpu)
    assert next(peer.parameters()).device.type == "cuda"
    assert outputs == [hf_greedy(peer, p, GREEDY.max_tokens) for p in prompts]
    draft = place_model(_model(5, d_model=16, n_layers=1), "cuda")
    speculative = GenerationEngine(gpu, 4, speculate=3, draft=draft)
    assert _run(speculative, [(p, GREEDY) for p in prompts]) == outputs
    seeded = [(p, s) for p, s in zip(prompts, SAMPLED, strict=False)]
    first = _run(GenerationEngine(gpu, 3), seeded)
    assert first == _run(GenerationEngine(gpu, 3), seeded)  # a seed repeats on the device
    assert first == [generate_without_cache(gpu, p, s).output for p, s in seeded]
    base = place_model(GPT(256, 32, 32, 2, 2), "cuda")
    adapted = GenerationEngine(base, max_num_seqs=2, max_adapters=1)
    adapted.adapters.add("a/1", *_scaled(_trained_adapter(1)))
    layer = next(iter(adapted.adapters.layers.values()))
    assert layer.lora_a.device.type == "cuda"
    sequence = adapted.add(_prompt(1, 6), GREEDY, adapted.adapters.acquire("a/1"))
    while adapted.busy:
        adapted.step()
    assert len(sequence.output) == GREEDY.max_tokens


@pytest.mark.gpu
@CUDA
def test_on_cuda_bf16_and_int8_weights_decode():
    model = _model(2)
    for dtype, quantization in (("bf16", "none"), ("bf16", "int8"), ("fp32", "int8")):
        if quantization == "int8":  # a bare GPU machine (torch, transformers, peft) has none
            pytest.importorskip("torchao", reason="torchao is not installed on this GPU machine")
        placed = place_model(copy.deepcopy(model), "cuda", dtype, quantization)
        engine = GenerationEngine(placed, max_num_seqs=2)
        outputs = _run(engine, [(_prompt(3, 6), GREEDY), (_prompt(4, 2), SAMPLED[0])])
        assert [len(o) for o in outputs] == [GREEDY.max_tokens, SAMPLED[0].max_tokens]
        assert engine.cache.keys[0].device.type == "cuda"


@pytest.mark.gpu
@CUDA
def test_on_cuda_the_captured_decode_step_decodes_the_eager_greedy_tokens():
    model = place_model(_model(3), "cuda")
    requests = [(_prompt(i, 2 + 5 * i), Sampling(max_tokens=9 + 5 * i, temperature=0))
                for i in range(6)]  # fmt: skip
    eager = _run(GenerationEngine(model, max_num_seqs=3), requests)
    graphed = GenerationEngine(model, max_num_seqs=3, decode="cuda_graph")
    assert _run(graphed, requests) == eager
    assert _run(GenerationEngine(model, max_num_seqs=3, decode="static"), requests) == eager
    bf16 = place_model(_model(3), "cuda", "bf16")
    assert _run(GenerationEngine(bf16, 3, decode="cuda_graph"), requests[:3])  # runs in bf16
