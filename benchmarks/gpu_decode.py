"""The generation half of `benchmarks/gpu.py`: raylane's engine on one device beside
`transformers` `generate()` on the same weights. Run `benchmarks/gpu.py`, not this file."""

from __future__ import annotations

import copy
import statistics
import time

import torch

from raylane.parallel.device import synchronize
from raylane.serving.generation.engine import GenerationEngine, generate_without_cache
from raylane.serving.generation.hf_peer import hf_greedy_batch, to_hf_gpt2
from raylane.serving.generation.next_token import Sampling
from raylane.serving.generation.placement import place_model
from raylane.serving.generation.quantize import bits_per_byte, quantize_int8, weight_bytes

PROMPT = b"import os\nimport sys\n\n\ndef main(argv):\n    "
SPECULATE = 4  # draft tokens proposed per step


def timed(function, repeats: int, device: torch.device) -> tuple[float, object]:
    """Median seconds of `repeats` calls of `function` (after one warm-up call), and what the
    last call returned."""
    function()
    seconds, value = [], None
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        value = function()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), value


def prompts_from(text: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` bytes from places spread over `text`."""
    stride = (len(text) - length) // count
    return [text[i * stride : i * stride + length].tolist() for i in range(count)]


def engine_run(engine: GenerationEngine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt through `engine` (a slot each: continuous batching at full load)."""
    greedy = Sampling(max_tokens=new_tokens, temperature=0)
    sequences = [engine.add(prompt, greedy) for prompt in prompts]
    while engine.busy:
        engine.step()
    return {
        "outputs": [s.output for s in sequences],
        "acceptance": engine.acceptance_rate,
        "forwards": engine.forwards,
    }


def decode_speeds(model, prompts, new_tokens, repeats, device, decode="dynamic") -> dict:
    """ms per token at batch 1 and tokens/s at len(prompts) sequences, the engine (its
    `decode` path; engines built, and graphs captured, before the clock starts) and HF."""
    one = [list(PROMPT)]
    single = GenerationEngine(model, max_num_seqs=1, decode=decode)
    full = GenerationEngine(model, max_num_seqs=len(prompts), decode=decode)
    engine_1, out_1 = timed(lambda: engine_run(single, one, new_tokens), repeats, device)
    engine_n, out_n = timed(lambda: engine_run(full, prompts, new_tokens), repeats, device)
    peer = to_hf_gpt2(model)
    hf_1, hf_out_1 = timed(lambda: hf_greedy_batch(peer, one, new_tokens), repeats, device)
    hf_n, hf_out_n = timed(lambda: hf_greedy_batch(peer, prompts, new_tokens), repeats, device)
    total = len(prompts) * new_tokens
    return {
        "decode": decode,
        "engine_ms_per_token_b1": engine_1 / new_tokens * 1e3,
        "engine_tokens_per_s": total / engine_n,
        "hf_ms_per_token_b1": hf_1 / new_tokens * 1e3,
        "hf_tokens_per_s": total / hf_n,
        "engine_over_hf": hf_n / engine_n,
        "same_as_hf_b1": out_1["outputs"] == hf_out_1,
        "same_as_hf_batch": out_n["outputs"] == hf_out_n,
        "tokens_b1": out_1["outputs"][0],
    }


def speculative_speed(model, draft, new_tokens, repeats, device, expected) -> dict:
    """Batch 1 with the draft proposing `SPECULATE` tokens a step, against plain decoding."""
    one = [list(PROMPT)]
    plain = GenerationEngine(model, max_num_seqs=1)
    speculative = GenerationEngine(model, max_num_seqs=1, speculate=SPECULATE, draft=draft)
    plain_s, _ = timed(lambda: engine_run(plain, one, new_tokens), repeats, device)
    spec_s, spec = timed(lambda: engine_run(speculative, one, new_tokens), repeats, device)
    return {
        "plain_ms_per_token": plain_s / new_tokens * 1e3,
        "speculative_ms_per_token": spec_s / new_tokens * 1e3,
        "speedup": plain_s / spec_s,
        "acceptance": spec["acceptance"],
        "same_as_plain": spec["outputs"][0] == expected,
    }


def weights_section(model, text: torch.Tensor, context: int, device) -> dict:
    """Bytes and bits per byte of the fp32 weights, bf16 and int8 (torchao, where installed)."""
    rows = min(16, (len(text) - 1) // context)
    span = text[: rows * context + 1].to(device)
    tokens, labels = span[:-1].view(rows, context), span[1:].view(rows, context)
    found = {"fp32_bytes": weight_bytes(model), "fp32_bpb": bits_per_byte(model, tokens, labels)}
    half = copy.deepcopy(model).to(torch.bfloat16)
    found.update(bf16_bytes=weight_bytes(half), bf16_bpb=bits_per_byte(half, tokens, labels))
    try:
        int8 = quantize_int8(copy.deepcopy(model))
    except ImportError as exc:
        found["int8"] = f"skipped: torchao is not installed ({exc})"
        return found
    found.update(int8_bytes=weight_bytes(int8), int8_bpb=bits_per_byte(int8, tokens, labels))
    return found


def generation_figures(model, draft, text, size, repeats, device) -> dict:
    """Everything the generation section reports, on a trained `model` and `draft`."""
    model, draft = place_model(model, device), place_model(draft, device)
    new_tokens = size["new_tokens"]
    prompts = prompts_from(text, size["concurrent"], len(PROMPT))
    greedy = Sampling(max_tokens=new_tokens, temperature=0)
    reference = generate_without_cache(model, list(PROMPT), greedy).output
    paths = ["dynamic", "static"] + (["cuda_graph"] if device.type == "cuda" else [])
    found = {}
    for path in paths:
        found[f"fp32_{path}"] = decode_speeds(model, prompts, new_tokens, repeats, device, path)
    found["greedy_same_every_path"] = all(
        found[f"fp32_{p}"]["tokens_b1"] == reference and found[f"fp32_{p}"]["same_as_hf_b1"]
        for p in paths
    )
    half = place_model(copy.deepcopy(model), device, dtype="bf16")
    for path in paths:
        found[f"bf16_{path}"] = decode_speeds(half, prompts, new_tokens, repeats, device, path)
    found["speculative"] = speculative_speed(model, draft, new_tokens, repeats, device, reference)
    found["weights"] = weights_section(model, text, model.pos_emb.num_embeddings, device)
    for figures in found.values():
        if isinstance(figures, dict):
            figures.pop("tokens_b1", None)
    return found
