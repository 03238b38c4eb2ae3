"""One LoRA training step of a Qwen2.5-0.5B-shaped model on this machine, its peak memory with
the whole vocabulary's logits, with the head and loss in chunks (`training.loss_chunk_mb`), and
with the blocks' activations recomputed as well (`training.activation_checkpointing`, a LoRA
run's default), with the frozen base held in bf16 as well (`finetune.base_dtype`), and with the
C allocator giving freed blocks back (`training.host_memory: lean`, a LoRA run's default).

A random model with Qwen2.5-0.5B's widths (494 M parameters: a 151,936-token vocabulary, 24
blocks of 896 wide, 14 query heads sharing 2 key/value heads, q/k/v biases, the head tied to the
embedding), built in place (no download), fp32, rank-8 LoRA on all seven projections of every
block, one worker's batch of 4 x 256 tokens; each variant in a fresh process (its peak resident
memory is the process's own), 2 steps after one warm-up, two torch threads each. Printed: each
variant's peak RSS and median step, the bytes the whole logits predict (4 x 256 x 151,936 fp32:
622 MB a copy), and whether the two losses and the adapters' gradients agree. The last line is
one JSON object.

    python benchmarks/real_size.py            # about 4 minutes
    python benchmarks/real_size.py --smoke    # the same at a tiny width, in seconds
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from harness import add_smoke_flag, print_last_line

#: Qwen2.5-0.5B's config.json widths.
QWEN_0P5B = dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                 ffn_dim=4864, tie_embeddings=True, qkv_bias=True, model_type="qwen2")  # fmt: skip
SMOKE = dict(vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
             tie_embeddings=True, qkv_bias=True, model_type="qwen2")  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS, TOKENS, STEPS = 4, 256, 2


def _adapted_model(widths: dict, recompute: bool, bf16_base: bool):
    """The model, rank-8 LoRA on every projection at a seeded random start (B is zero at first:
    its gradients are what differ), its blocks checkpointed and its base held in bf16 (built in
    it, as a bf16 checkpoint is read) as asked."""
    import torch

    from raylane.config.finetune import FinetuneConfig
    from raylane.models.adapters import apply_lora
    from raylane.models.frozen import hold_frozen
    from raylane.models.llama import LlamaConfig, LlamaForCausalLM
    from raylane.parallel.parallelize import checkpoint_blocks

    torch.set_default_dtype(torch.bfloat16 if bf16_base else torch.float32)
    model = LlamaForCausalLM(LlamaConfig(**widths, max_positions=TOKENS))
    torch.set_default_dtype(torch.float32)
    settings = FinetuneConfig(base="models:/base/1", rank=8, alpha=16, target_modules=TARGETS)
    if bf16_base:  # as a run does: held first, the adapters then made in fp32
        model.requires_grad_(False)
        hold_frozen(model, torch.bfloat16, torch.float32)
    apply_lora(model, settings)
    if recompute:
        checkpoint_blocks(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.normal_(std=0.01, generator=torch.Generator().manual_seed(1))
    return model


def one_variant(
    chunk_mb: float, recompute: bool, smoke: bool, bf16_base: bool = False, lean: bool = False
) -> dict:
    """In this process: build and adapt (`_adapted_model`), and time `STEPS` steps after a
    warm-up."""
    import torch

    from raylane.models.losses import cross_entropy
    from raylane.runtime import apply_host_memory

    torch.set_num_threads(2)
    torch.manual_seed(0)
    if lean:
        apply_host_memory("lean")
    widths = SMOKE if smoke else QWEN_0P5B
    model = _adapted_model(widths, recompute, bf16_base)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    tokens = torch.randint(0, widths["vocab_size"], (ROWS, TOKENS + 1),
                           generator=torch.Generator().manual_seed(2))  # fmt: skip
    x, t = tokens[:, :-1], tokens[:, 1:]
    seconds, first = [], None
    for step in range(STEPS + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if chunk_mb:
            loss = model(x, targets=t, chunk_bytes=chunk_mb * 2**20)
        else:
            loss = cross_entropy(model(x).float(), t)
        loss.backward()
        if step == 0:
            first = (loss.item(), torch.cat([p.grad.flatten() for p in trainable]))
        optimizer.step()
        if step:
            seconds.append(time.perf_counter() - started)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "peak_rss_mb": peak_kb / 1024,
        "step_s": statistics.median(seconds),
        "loss": first[0],
        "grads": first[1].tolist()
        if smoke
        else first[1][:: max(1, first[1].numel() // 4096)].tolist(),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def run_variant(
    chunk_mb: float, smoke: bool, recompute: bool = False, bf16: bool = False, lean: bool = False
) -> dict:
    command = [sys.executable, __file__, "--variant", str(chunk_mb)]
    command += (["--recompute"] if recompute else []) + (["--smoke"] if smoke else [])
    command += (["--bf16-base"] if bf16 else []) + (["--lean"] if lean else [])
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16-base", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lean", action="store_true", help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.variant is not None:
        variant = one_variant(args.variant, args.recompute, args.smoke, args.bf16_base, args.lean)
        print(json.dumps(variant))
        return
    # The smoke's logits (16 MB) fit one 64 MB chunk: it cuts them in 1 MB chunks instead.
    chunk_mb = 1.0 if args.smoke else 64.0
    whole, chunked = run_variant(0.0, args.smoke), run_variant(chunk_mb, args.smoke)
    recomputed = run_variant(chunk_mb, args.smoke, recompute=True)
    held = run_variant(chunk_mb, args.smoke, recompute=True, bf16=True)
    lean = run_variant(chunk_mb, args.smoke, recompute=True, bf16=True, lean=True)
    widths = SMOKE if args.smoke else QWEN_0P5B
    logits_mb = ROWS * TOKENS * widths["vocab_size"] * 4 / 2**20
    grad_diff = max(abs(a - b) for a, b in zip(whole["grads"], chunked["grads"], strict=True))
    for name, run in (("whole logits", whole), (f"chunked ({chunk_mb:g} MB)", chunked),
                      ("+ recomputed", recomputed), ("+ bf16 base", held),
                      ("+ lean host memory", lean)):  # fmt: skip
        print(f"{name:16s} peak RSS {run['peak_rss_mb']:8.0f} MB   step {run['step_s']:6.2f} s")
    figures = {
        "parameters": whole["parameters"],
        "chunk_mb": chunk_mb,
        "logits_mb_per_copy": round(logits_mb, 1),
        "whole_peak_mb": round(whole["peak_rss_mb"]),
        "chunked_peak_mb": round(chunked["peak_rss_mb"]),
        "peak_saved_mb": round(whole["peak_rss_mb"] - chunked["peak_rss_mb"]),
        "chunked_vs_whole_step": round(chunked["step_s"] / whole["step_s"], 3),
        "recomputed_peak_mb": round(recomputed["peak_rss_mb"]),
        "recomputed_vs_whole_step": round(recomputed["step_s"] / whole["step_s"], 3),
        "recomputed_grad_diff": max(
            abs(a - b) for a, b in zip(whole["grads"], recomputed["grads"], strict=True)
        ),
        "bf16_base_peak_mb": round(held["peak_rss_mb"]),
        "bf16_base_vs_whole_step": round(held["step_s"] / whole["step_s"], 3),
        # Its base is built in bf16 (other values than the fp32 base's, rounded): near, not equal.
        "bf16_base_loss_diff": abs(whole["loss"] - held["loss"]),
        "lean_peak_mb": round(lean["peak_rss_mb"]),
        "lean_vs_whole_step": round(lean["step_s"] / whole["step_s"], 3),
        "lean_loss_diff": abs(held["loss"] - lean["loss"]),
        "loss_diff": abs(whole["loss"] - chunked["loss"]),
        "grad_diff": grad_diff,
    }
    print_last_line(figures, args.smoke)


if __name__ == "__main__":
    main()
