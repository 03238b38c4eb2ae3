"""Text generation, side by side in one run on the same weights (one torch thread each):

  (a) one stream, `--new-tokens` new tokens: every token from a forward over the whole
      sequence so far (no cache) against raylane's KV-cache decoding; `kv_vs_nocache`;
  (b) the same stream through `transformers`' `generate()` with its KV cache, on a GPT-2
      built from the same dimensions with raylane's weights copied in: tokens must be
      identical under greedy decoding; `raylane_vs_hf_generate` (raylane tokens/s over HF's);
  (c) `--requests` requests arriving as a Poisson process (`--rate` per second) with output
      lengths drawn from 8-256 tokens, on one engine with `--slots` cache slots: request-level
      batching (a batch forms from what is waiting and every row decodes until its longest
      member ends, as a batched `generate()` behind `@serve.batch` runs whole requests; a
      finished request's later tokens are padding) against continuous batching (requests join and
      leave between decode steps); throughput and p50/p99 time to first token;
      `continuous_vs_static`, `ttft_p99_ratio` (continuous over static);
  (d) int8 weights (torchao weight-only, `serving.quantization: int8`) against fp32: weight
      bytes, validation bits per byte (`--eval-windows` windows of the config's validation
      split, prepared if missing) and single-stream tokens/s; `int8_bytes_ratio`,
      `int8_bpb_delta` (relative), `int8_speed_ratio`;
  (e) the stream of (a) with speculative decoding (`--speculate` tokens proposed per step,
      checked in one forward) against plain KV-cache decoding, greedy tokens identical: the
      proposals from the draft model of `--draft-config` (`spec_speedup`, `spec_acceptance`)
      and from prompt lookup in the sequence's own text (`lookup_speedup`,
      `lookup_acceptance`);
  (f) speculative decoding with the draft on varied text: `--varied-prompts` prompts cut from
      the validation split (real standard-library source), sampled at temperature 0.8 with a
      seed per prompt, against plain sampled decoding of the same prompts
      (`varied_spec_speedup`, `varied_spec_acceptance`; sampled output keeps the target's
      distribution, not its draws, so the tokens are not compared).

Weights: the config's registered model (its champion, or `--set serving.model_version=N`)
when the MLflow store has one, else the config's architecture freshly initialised (timing
does not depend on the weights; the script says which it used); the same for the draft.
Figures that depend on the weights (bits per byte, acceptance and the speed-ups it brings) are
null when their model was not trained: train both first. Medians over `--repeat`. `--smoke`:
each section once, fresh weights of a small GPT (no registry lookup), data in a temp dir.

    python benchmarks/generate_load.py [--config configs/train/lm_serve.yaml] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import add_smoke_flag, print_last_line

from raylane.config import load_config
from raylane.data import ensure_dataset
from raylane.data.parquet import read_rows
from raylane.models import build_model
from raylane.serving.app import resolve_served_version
from raylane.serving.generation.engine import GenerationEngine, generate_without_cache
from raylane.serving.generation.hf_peer import hf_greedy, to_hf_gpt2
from raylane.serving.generation.loader import load_language_model
from raylane.serving.generation.quantize import bits_per_byte, quantize_int8, weight_bytes
from raylane.serving.generation.sampling import SamplingParams
from raylane.tracking import resolve_tracking_uri

ROOT = Path(__file__).resolve().parents[1]
PROMPT = b"import os\nimport sys\n\n\ndef main(argv):\n    "
#: Figures that mean something only for trained weights: of the model, of the draft.
MODEL_FIGURES = ("fp32_bpb", "int8_bpb_delta", "lookup_speedup", "lookup_acceptance")
DRAFT_FIGURES = (
    "spec_speedup", "spec_acceptance", "varied_spec_speedup", "varied_spec_acceptance"
)  # fmt: skip
#: --smoke: a small model and its data in a temporary directory (prompts of 64 bytes fit).
SMOKE_CONFIG = ["model.d_model=32", "model.n_layers=2", "model.input_dim=128"]
FRESH = "fresh weights"


def load_weights(cfg, registry: bool = True):
    """The registered model, else fresh weights; its source (`FRESH...` when untrained)."""
    if not registry:
        torch.manual_seed(0)
        return build_model(cfg.model).eval(), f"{FRESH} (--smoke: no registry lookup)"
    try:
        uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
        version = resolve_served_version(cfg, uri)
        model, card = load_language_model(uri, cfg.tracking.registered_model, version)
        return model, f"{card.registered_model} v{card.version}"
    except Exception as exc:  # noqa: BLE001 - no registered model: time fresh weights
        torch.manual_seed(0)
        return build_model(cfg.model).eval(), f"{FRESH} ({type(exc).__name__})"


def untrained_left_out(result: dict) -> dict:
    """`result` with the figures that untrained weights would make meaningless set to null."""
    left_out = [
        *(MODEL_FIGURES if result["weights"].startswith(FRESH) else ()),
        *(DRAFT_FIGURES if result["spec_draft"].startswith(FRESH) else ()),
    ]
    if left_out:
        print(f"untrained weights: {', '.join(left_out)} left out (null)", flush=True)
    return {**result, **dict.fromkeys(left_out)}


def single_stream(model, new_tokens: int) -> dict:
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0)
    prompt = list(PROMPT)
    started = time.perf_counter()
    plain = generate_without_cache(model, prompt, greedy).output
    nocache_s = time.perf_counter() - started
    engine = GenerationEngine(model, max_num_seqs=1)
    started = time.perf_counter()
    cached = engine.generate(prompt, greedy).output
    kv_s = time.perf_counter() - started
    return {"nocache_s": nocache_s, "kv_s": kv_s, "same": plain == cached, "tokens": cached}


def speculative_stream(
    model, new_tokens: int, speculate: int, expected: list[int], draft=None
) -> dict:
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0)
    engine = GenerationEngine(model, max_num_seqs=1, speculate=speculate, draft=draft)
    started = time.perf_counter()
    tokens = engine.generate(list(PROMPT), greedy).output
    return {
        "spec_s": time.perf_counter() - started,
        "same": tokens == expected,
        "acceptance": engine.acceptance_rate or 0.0,
        "forwards": engine.forwards,
        "draft_forwards": engine.draft_forwards,
    }


def int8_comparison(cfg, model, new_tokens: int, windows: int) -> dict:
    import copy

    ensure_dataset(cfg)
    tokens, labels = (
        torch.as_tensor(a).long() for a in read_rows(cfg.data.validation_path, cfg, limit=windows)
    )
    quantized = quantize_int8(copy.deepcopy(model))
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0)
    timing = {}
    for name, candidate in (("fp32", model), ("int8", quantized)):
        engine = GenerationEngine(candidate, max_num_seqs=1)
        engine.generate(list(PROMPT), greedy.model_copy(update={"max_tokens": 4}))  # warm-up
        started = time.perf_counter()
        engine.generate(list(PROMPT), greedy)
        timing[name] = time.perf_counter() - started
    fp32_bpb, int8_bpb = (
        bits_per_byte(model, tokens, labels),
        bits_per_byte(quantized, tokens, labels),
    )
    return {
        "fp32_bytes": weight_bytes(model),
        "int8_bytes": weight_bytes(quantized),
        "fp32_bpb": fp32_bpb,
        "int8_bpb": int8_bpb,
        "fp32_s": timing["fp32"],
        "int8_s": timing["int8"],
    }


def hf_stream(model, new_tokens: int, expected: list[int]) -> dict:
    peer = to_hf_gpt2(model)
    hf_greedy(peer, list(PROMPT), 4)  # warm-up: first-call set-up is not decoding
    started = time.perf_counter()
    tokens = hf_greedy(peer, list(PROMPT), new_tokens)
    return {"hf_s": time.perf_counter() - started, "same": tokens == expected}


def varied_prompts(cfg, count: int, length: int = 64) -> list[list[int]]:
    """`count` prompts of `length` bytes from windows spread over the validation split."""
    ensure_dataset(cfg)
    tokens, _ = read_rows(cfg.data.validation_path, cfg, limit=16 * count)
    return [list(map(int, tokens[16 * i][:length])) for i in range(count)]


def varied_speculative(model, draft, prompts, new_tokens: int, speculate: int) -> dict:
    """Sampled decoding of every prompt, plain and with the draft proposing `speculate`."""
    seconds, accepted = {}, []
    for name, k in (("plain", 0), ("spec", speculate)):
        started = time.perf_counter()
        for seed, prompt in enumerate(prompts):
            engine = GenerationEngine(
                model, max_num_seqs=1, speculate=k, draft=draft if k else None
            )
            params = SamplingParams(max_tokens=new_tokens, temperature=0.8, seed=seed)
            assert len(engine.generate(prompt, params).output) == new_tokens
            if k:
                accepted.append(engine.acceptance_rate or 0.0)
        seconds[name] = time.perf_counter() - started
    return {
        "plain_s": seconds["plain"],
        "spec_s": seconds["spec"],
        "acceptance": statistics.mean(accepted),
    }


def arrivals(requests: int, rate: float, seed: int, longest: int) -> list[tuple[float, int]]:
    """(arrival time s, output length) per request: Poisson arrivals, lengths 8-256 (at most
    `longest`, what the context leaves after the prompt)."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate)
        out.append((at, rng.randint(8, min(256, longest))))
    return out


def serve_trace(model, trace, slots: int, continuous: bool) -> dict:
    """Replay `trace` in real time on one engine. Continuous: waiting requests are admitted
    at every step and leave the batch when done. Static (request-level, as `@serve.batch`
    hands a batched `generate()` whole requests): once the engine is idle, up to `slots` of the
    requests that arrived form a batch that decodes until its longest member ends, every row
    computing to the end (a finished request's later tokens are padding: not counted)."""
    from collections import deque

    engine = GenerationEngine(model, max_num_seqs=slots)
    pending, arrived = deque(trace), deque()
    start = time.perf_counter()
    ttft, useful, submitted = [], {}, {}
    while pending or arrived or engine.busy:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrived.append(pending.popleft())
        if arrived and (continuous or not engine.busy):
            batch = [arrived.popleft() for _ in range(len(arrived) if continuous else slots)
                     if arrived]  # fmt: skip
            longest = max(length for _, length in batch)
            for at, length in batch:
                tokens = length if continuous else longest
                sequence = engine.add(
                    list(PROMPT), SamplingParams(max_tokens=tokens, temperature=0)
                )
                submitted[sequence.id], useful[sequence.id] = at, length
        if not engine.busy:
            time.sleep(min(0.01, pending[0][0] - now))
            continue
        events = engine.step()
        clock = time.perf_counter() - start
        ttft += [clock - submitted[e.sequence.id] for e in events if len(e.sequence.output) == 1]
    elapsed = time.perf_counter() - start
    ttft.sort()
    return {
        "tokens_per_s": sum(useful.values()) / elapsed,
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "elapsed_s": elapsed,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "train" / "lm_serve.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--draft-config", default=str(ROOT / "configs" / "train" / "lm_draft.yaml"))
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--varied-prompts", type=int, default=4)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.repeat, args.new_tokens, args.requests, args.slots = 1, 8, 4, 2
        args.eval_windows, args.varied_prompts = 4, 1
    return args


def stream_runs(model, draft, prompts, new_tokens: int, varied_tokens: int, args) -> dict:
    """(a), (b), (e) and (f), `--repeat` times, each run printed as it ends: the runs' figures
    by name ('single', 'hf', 'spec', 'lookup', 'varied')."""
    single, hf, spec, lookup, varied = [], [], [], [], []
    for index in range(args.repeat):
        single.append(single_stream(model, new_tokens))
        expected = single[-1]["tokens"]
        hf.append(hf_stream(model, new_tokens, expected))
        spec.append(speculative_stream(model, new_tokens, args.speculate, expected, draft))
        lookup.append(speculative_stream(model, new_tokens, args.speculate, expected))
        varied.append(varied_speculative(model, draft, prompts, varied_tokens, args.speculate))
        print(
            f"run {index + 1}: no cache {single[-1]['nocache_s']:.2f} s, KV cache "
            f"{single[-1]['kv_s']:.2f} s, transformers generate {hf[-1]['hf_s']:.2f} s, "
            f"draft {spec[-1]['spec_s']:.2f} s (accepted {spec[-1]['acceptance']:.0%}, "
            f"{spec[-1]['forwards']} forwards, {spec[-1]['draft_forwards']} of the draft), "
            f"prompt lookup {lookup[-1]['spec_s']:.2f} s "
            f"(accepted {lookup[-1]['acceptance']:.0%}, {lookup[-1]['forwards']} forwards); "
            f"varied text sampled: plain {varied[-1]['plain_s']:.2f} s, draft "
            f"{varied[-1]['spec_s']:.2f} s (accepted {varied[-1]['acceptance']:.0%})",
            flush=True,
        )
    return {"single": single, "hf": hf, "spec": spec, "lookup": lookup, "varied": varied}


def batching_runs(model, trace, args) -> dict[str, list[dict]]:
    """(c): static and continuous batching of the same trace, `--repeat` times each."""
    batching = {"static": [], "continuous": []}
    for _ in range(args.repeat):
        for name in batching:
            batching[name].append(serve_trace(model, trace, args.slots, name == "continuous"))
        print(
            "static {:.0f} tok/s (TTFT p99 {:.2f} s), continuous {:.0f} tok/s (TTFT p99 {:.2f} s)"
            .format(*(batching[n][-1][k] for n in batching for k in ("tokens_per_s",
                                                                      "ttft_p99_s"))),
            flush=True,
        )  # fmt: skip
    return batching


def med(rows, key):
    return statistics.median(r[key] for r in rows)


def summary(runs: dict, source: str, draft_source: str, new_tokens: int, args) -> dict:
    """The last line's figures, from the medians of every section's runs."""
    single, hf, spec, lookup = runs["single"], runs["hf"], runs["spec"], runs["lookup"]
    varied, int8, static, cont = runs["varied"], runs["int8"], runs["static"], runs["continuous"]
    return {
        "weights": source,
        "new_tokens": new_tokens,
        "kv_vs_nocache": round(med(single, "nocache_s") / med(single, "kv_s"), 2),
        "kv_tokens_per_s": round(new_tokens / med(single, "kv_s"), 1),
        "hf_tokens_per_s": round(new_tokens / med(hf, "hf_s"), 1),
        "raylane_vs_hf_generate": round(med(hf, "hf_s") / med(single, "kv_s"), 2),
        "int8_bytes_ratio": round(med(int8, "int8_bytes") / med(int8, "fp32_bytes"), 3),
        "int8_bpb_delta": round(
            (med(int8, "int8_bpb") - med(int8, "fp32_bpb")) / med(int8, "fp32_bpb"), 4
        ),
        "int8_speed_ratio": round(med(int8, "fp32_s") / med(int8, "int8_s"), 2),
        "fp32_bpb": round(med(int8, "fp32_bpb"), 4),
        "spec_speedup": round(med(single, "kv_s") / med(spec, "spec_s"), 2),
        "spec_acceptance": round(med(spec, "acceptance"), 3),
        "spec_draft": draft_source,
        "lookup_speedup": round(med(single, "kv_s") / med(lookup, "spec_s"), 2),
        "lookup_acceptance": round(med(lookup, "acceptance"), 3),
        "varied_spec_speedup": round(med(varied, "plain_s") / med(varied, "spec_s"), 2),
        "varied_spec_acceptance": round(med(varied, "acceptance"), 3),
        "varied_prompts": args.varied_prompts,
        "greedy_identical": all(r["same"] for r in single + hf + spec + lookup),
        "continuous_vs_static": round(med(cont, "tokens_per_s") / med(static, "tokens_per_s"), 2),
        "ttft_p99_ratio": round(med(cont, "ttft_p99_s") / med(static, "ttft_p99_s"), 2),
        "static": {k: round(med(static, k), 3) for k in static[0]},
        "continuous": {k: round(med(cont, k), 3) for k in cont[0]},
        "repeat": args.repeat,
    }


def load_models(args, workdir: Path):
    """The config, the model and the draft, each with where its weights came from."""
    smoke = [
        *SMOKE_CONFIG,
        "data.max_bytes=65536",
        f"data.train_path={workdir}/train.parquet",
        f"data.validation_path={workdir}/validation.parquet",
    ]
    extra = smoke if args.smoke else []
    cfg = load_config(args.config, [*args.overrides, *extra])
    model, source = load_weights(cfg, registry=not args.smoke)
    draft_cfg = load_config(args.draft_config, extra)
    draft, draft_source = load_weights(draft_cfg, registry=not args.smoke)
    return cfg, (model, source), (draft, draft_source)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, (model, source), (draft, draft_source) = load_models(args, Path(tmp))
        result = measure(args, cfg, model, source, draft, draft_source)
    print_last_line(untrained_left_out(result), args.smoke)
    sys.exit(0 if result["greedy_identical"] else 1)


def measure(args, cfg, model, source: str, draft, draft_source: str) -> dict:
    """Every section, printed as it ends; the last line's figures."""
    context = cfg.model.input_dim
    new_tokens = min(args.new_tokens, context - len(PROMPT))
    print(f"weights: {source}; context {context}, {new_tokens} new tokens", flush=True)
    print(f"draft: {draft_source}", flush=True)

    prompts = varied_prompts(cfg, args.varied_prompts)
    varied_tokens = min(new_tokens, context - max(map(len, prompts)))
    runs = stream_runs(model, draft, prompts, new_tokens, varied_tokens, args)
    int8 = [int8_comparison(cfg, model, new_tokens, args.eval_windows) for _ in range(args.repeat)]
    print(
        "int8: {int8_bytes:,} bytes against {fp32_bytes:,}; {int8_bpb:.4f} bits/byte against "
        "{fp32_bpb:.4f}; {int8_s:.2f} s against {fp32_s:.2f} s per stream".format(**int8[-1]),
        flush=True,
    )
    sample_text = (PROMPT + bytes(runs["single"][0]["tokens"])).decode("utf-8", errors="replace")
    print("greedy sample:\n" + sample_text, flush=True)
    trace = arrivals(args.requests, args.rate, seed=0, longest=context - len(PROMPT))
    runs |= {"int8": int8, **batching_runs(model, trace, args)}
    return summary(runs, source, draft_source, new_tokens, args)


if __name__ == "__main__":
    main()
