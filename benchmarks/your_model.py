"""A user's Llama side by side with `transformers`: training step, generation, LoRA's footprint.

In-process, no Ray. One ~20M-parameter Llama (vocabulary 8192, d_model 384, 8 blocks, 6 query
and 2 key/value heads, SwiGLU 1024), random, written with raylane's `save_pretrained` and read
back by `transformers.LlamaForCausalLM.from_pretrained`, so both hold the same weights (their
logits are compared first: max abs difference, fp32).

- **train**: the median seconds of one training step (forward, cross-entropy, backward, AdamW
  step) on the same batch, raylane's step (`StrategyDefaults.train_step`, the step every
  raylane run takes) against the same step written for `LlamaForCausalLM`; same threads.
  `train_vs_hf` = HF's median / raylane's (>= 1.0: raylane at least as fast).
- **generate**: 8 concurrent greedy requests of `--new-tokens` tokens each: raylane's engine
  (KV cache, continuous batching, all 8 decoding together) against `transformers`' `generate()`
  on the 8 prompts as one left-padded batch (its KV cache). Tokens per second of wall time;
  `generate_vs_hf` = raylane's / HF's (medians of 3 rounds). The greedy tokens of the first
  prompt are compared.
- **lora**: the adapters `configs/finetune/llama_lora.yaml` sets (rank 4 on q, k, v, o, gate,
  up and down: every linear layer of the blocks, as QLoRA recommends, at a small rank;
  `raylane.models.adapters`): `trainable_fraction` and `adapter_bytes_ratio` (the adapter's
  safetensors / the base's). `--lora-only` measures these alone (a few seconds).

The last line printed is one JSON object with those figures.

    python benchmarks/your_model.py [--threads 2] [--steps 12] [--new-tokens 32] [--lora-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import transformers
import yaml
from safetensors.torch import save_file

from raylane.config.finetune import FinetuneConfig
from raylane.data.tokenizer import train_bpe
from raylane.models.adapters import adapter_state, apply_lora
from raylane.models.hf_checkpoint import save_pretrained
from raylane.models.llama import LlamaConfig, LlamaForCausalLM
from raylane.models.losses import cross_entropy
from raylane.parallel.base import StrategyDefaults
from raylane.serving.generation.engine import GenerationEngine
from raylane.serving.generation.sampling import SamplingParams
from raylane.serving.generation.tokenizer_codec import load_codec

CONFIG = LlamaConfig(vocab_size=8192, d_model=384, n_layers=8, n_heads=6, n_kv_heads=2,
                     ffn_dim=1024, max_positions=256)  # fmt: skip
BATCH, SEQ, WARMUP, CONCURRENT, REPEATS = 8, 128, 3, 8, 3
#: The shipped LoRA fine-tuning of an imported Llama, whose adapters the footprint measures.
LORA_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "finetune" / "llama_lora.yaml"


class OneProcess(StrategyDefaults):
    """raylane's one training step, on this process."""

    def __init__(self):
        self.precision = "fp32"
        self.last_step_parts: dict[str, float] = {}


def twins(directory: Path) -> tuple[LlamaForCausalLM, torch.nn.Module, float]:
    """raylane's Llama and `transformers`' on the same weights; their logits' max difference."""
    torch.manual_seed(0)
    ours = LlamaForCausalLM(CONFIG)
    save_pretrained(ours, directory)
    theirs = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        apart = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    return ours, theirs, apart


def _median_step(step, steps: int) -> float:
    seconds = []
    for _ in range(WARMUP + steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[WARMUP:])


def train_steps(ours, theirs, steps: int) -> dict[str, float]:
    """Median step seconds of each on the same batch, AdamW at the same settings."""
    rows = torch.randint(
        0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2)
    )
    inputs, targets = rows[:, :-1], rows[:, 1:]
    runner = OneProcess()
    our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    ours.train(), theirs.train()

    def hf_step():
        their_opt.zero_grad(set_to_none=True)
        logits = theirs(input_ids=inputs).logits
        cross_entropy(logits, targets).backward()
        their_opt.step()

    raylane_s = _median_step(
        lambda: runner.train_step(ours, our_opt, cross_entropy, inputs, targets), steps
    )
    hf_s = _median_step(hf_step, steps)
    return {"raylane_step_s": raylane_s, "hf_step_s": hf_s, "train_vs_hf": hf_s / raylane_s}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = [12, 20, 16, 24, 10, 18, 22, 14]
    return [
        torch.randint(1, CONFIG.vocab_size, (n,), generator=generator).tolist() for n in lengths
    ]


@torch.no_grad()
def generate(ours, theirs, new_tokens: int, directory: Path) -> dict[str, float]:
    """Tokens per second of 8 concurrent greedy requests, raylane's engine and HF generate,
    each the median of `REPEATS` rounds taken in turn (a round of each, then the next)."""
    ours.eval(), theirs.eval()
    asked = prompts()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    engine = GenerationEngine(ours, max_num_seqs=CONCURRENT, codec=_codec(directory))
    width = max(map(len, asked))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in asked])
    mask = torch.arange(width)[None] >= torch.tensor([width - len(p) for p in asked])[:, None]
    settings = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    engine.generate(asked[0], params)  # warm-up
    theirs.generate(input_ids=ids[:1, -len(asked[0]) :], **settings)
    ours_s, hf_s = [], []
    for _ in range(REPEATS):
        started = time.perf_counter()
        sequences = [engine.add(p, params) for p in asked]
        while engine.busy:
            engine.step()
        ours_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        out = theirs.generate(input_ids=ids, attention_mask=mask.long(), **settings)
        hf_s.append(time.perf_counter() - started)
    total, ours_s, hf_s = (
        CONCURRENT * new_tokens,
        statistics.median(ours_s),
        statistics.median(hf_s),
    )
    first_equal = sequences[0].output == out[0, width:].tolist()
    return {"raylane_tokens_per_s": total / ours_s, "hf_tokens_per_s": total / hf_s,
            "generate_vs_hf": hf_s / ours_s, "greedy_first_equal": first_equal}  # fmt: skip


def _codec(directory: Path):
    """The model's codec: a byte-level BPE of its vocabulary trained on the standard library's
    source, with no end-of-sequence id (a random model would stop at one by chance, and each
    request is to decode exactly its tokens, as HF's `min_new_tokens` makes it)."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
        if total > 4_000_000:
            break
    (directory / "tokenizer.json").write_bytes(train_bpe(texts, CONFIG.vocab_size).file_bytes())
    return dataclasses.replace(load_codec(directory), eos_ids=frozenset())


def lora_settings() -> FinetuneConfig:
    """The `finetune:` section of the shipped LoRA config (rank, alpha, target modules)."""
    return FinetuneConfig.model_validate(yaml.safe_load(LORA_CONFIG.read_text())["finetune"])


def lora_footprint(ours, directory: Path) -> dict[str, float]:
    settings = lora_settings()
    model = apply_lora(ours, settings)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    save_file(adapter_state(model), directory / "adapter.safetensors")
    base_bytes = (directory / "model.safetensors").stat().st_size
    adapter_bytes = (directory / "adapter.safetensors").stat().st_size
    return {
        "lora_rank": settings.rank,
        "lora_targets": ",".join(settings.target_modules),
        "trainable_fraction": trainable / total,
        "adapter_bytes_ratio": adapter_bytes / base_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--lora-only", action="store_true", help="LoRA's footprint alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs, apart = twins(Path(tmp))
        params = sum(p.numel() for p in ours.parameters())
        print(f"Llama {params / 1e6:.1f}M parameters; logits vs transformers: max abs {apart:.1e}")
        result = {"parameters": params, "logits_max_abs": apart, "threads": args.threads}
        if not args.lora_only:
            result |= train_steps(ours, theirs, args.steps)
            print(f"train step: raylane {result['raylane_step_s']:.3f} s, transformers "
                  f"{result['hf_step_s']:.3f} s (x{result['train_vs_hf']:.2f})")  # fmt: skip
            result |= generate(ours, theirs, args.new_tokens, Path(tmp))
            print(f"generate, {CONCURRENT} concurrent: raylane "
                  f"{result['raylane_tokens_per_s']:.0f} tok/s, transformers "
                  f"{result['hf_tokens_per_s']:.0f} tok/s "
                  f"(x{result['generate_vs_hf']:.2f})")  # fmt: skip
        result |= lora_footprint(ours, Path(tmp))
        print(f"LoRA rank {result['lora_rank']} on {result['lora_targets']}: trainable "
              f"{result['trainable_fraction']:.4f}, adapter/base bytes "
              f"{result['adapter_bytes_ratio']:.4f}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
