"""Fine-tuning side by side: full against LoRA, fp32 against bf16, from one base on a new domain.

In-process, no Ray, one torch thread. A base is trained briefly on `python-stdlib` byte windows
(the standard library's top-level modules): the architecture of configs/finetune/lm_lora.yaml
(d_model 128, 4 blocks) with a 64-byte context, AdamW at lm_serve.yaml's learning rate. From
that same base, on the same batches of `python-stdlib-tests` (the standard library's test
suite, text the base never read), the same number of steps, with raylane's own training step
(`StrategyDefaults.train_step`) and lm_lora.yaml's settings (rank, alpha, target modules,
learning rate, batch): full fine-tuning (fp32), LoRA (fp32) and LoRA in bf16 (autocast over
fp32 master weights, `raylane.parallel.precision`). For each: the trainable fraction, the
model-state bytes allocated (parameters + gradients + optimizer state, as every run records
them), samples/s (the median step after warm-up), the validation loss on the new domain before
and after (evaluated in the run's precision, as a run evaluates), and the artifact a run
registers: the adapter's safetensors against the whole state dict's.

The last line printed is one JSON object: `trainable_fraction`, `state_bytes_ratio` (LoRA /
full), `loss_ratio` (LoRA / full validation loss after the steps), `adapter_bytes_ratio`,
`bf16_loss_ratio` (LoRA bf16 / LoRA fp32), `bf16_speed_ratio` (samples/s, bf16 / fp32),
`bf16_fast` (the CPU's bf16 matrix instructions, from /proc/cpuinfo), and the figures of each.

    python benchmarks/finetune.py [--base-steps 300] [--steps 100] [--context 64] [--smoke]

`--smoke` trains a d_model 32, 2-block base for 2 steps on 64 KB, fine-tunes each run for 6
steps at one learning rate, and serves 4 requests once.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from harness import add_smoke_flag, print_last_line

from raylane.config import load_config
from raylane.data.text import stdlib_source_files, token_windows
from raylane.models import build_model
from raylane.models.adapters import adapter_state, apply_lora, load_adapter, merge_adapters
from raylane.models.losses import cross_entropy
from raylane.models.optim import build_optimizer
from raylane.parallel.base import StrategyDefaults
from raylane.parallel.meters import model_state_bytes
from raylane.parallel.precision import bf16_speed
from raylane.serving.generation.engine import GenerationEngine
from raylane.serving.generation.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5  # steps left out of the median (allocator and oneDNN warm-up)
#: Each method at the best of a few learning rates (by validation loss after the steps): full
#: fine-tuning moves every weight and wants a smaller rate than low-rank updates from zero
#: (Hu et al. 2021 tune them separately too). The bf16 run takes fp32 LoRA's best.
LEARNING_RATES = {"full": (3e-4, 1e-3, 3e-3), "lora": (3e-3, 1e-2)}
REQUESTS, REPEATS = 32, 3  # multi-adapter serving: requests per measurement, measurements
#: --smoke: the smallest model and data that run every part (6 steps: one past the warm-up).
SMOKE = {"base_steps": 2, "steps": WARMUP + 1, "context": 32, "batch": 4}
SMOKE_CONFIG = ["model.d_model=32", "model.n_layers=2", "data.max_bytes=65536"]
RUNS = {  # name: (finetune.method, training.precision)
    "full": ("full", "fp32"),
    "lora": ("lora", "fp32"),
    "lora_bf16": ("lora", "bf16"),
}


class OneProcess(StrategyDefaults):
    """raylane's one training step and evaluation forward, on this process."""

    def __init__(self, precision: str):
        self.precision = precision
        self.last_step_parts: dict[str, float] = {}


def windows(cfg, context: int, seed: int) -> dict[str, torch.Tensor]:
    """A source's byte windows split as `raylane prepare` splits them: tokens `[N, T + 1]`."""
    data = cfg.data
    text = b"".join(p.read_bytes() for p in stdlib_source_files(data.max_bytes, data.source))
    inputs, targets = token_windows(text, context)
    rows = np.concatenate([inputs, targets[:, -1:]], axis=1)
    order = np.random.default_rng(data.split_seed).permutation(len(rows))
    n_val = max(1, round(len(order) * data.validation_fraction))
    split = {"validation": order[:n_val], "train": order[n_val:]}
    found = {name: torch.from_numpy(rows[index]) for name, index in split.items()}
    shuffled = torch.randperm(len(found["train"]), generator=torch.Generator().manual_seed(seed))
    found["train"] = found["train"][shuffled]
    return found


def batches(tokens: torch.Tensor, batch: int, steps: int):
    """`steps` batches, cycling through the rows in order."""
    for step in range(steps):
        start = step * batch % max(len(tokens) - batch, 1)
        yield tokens[start : start + batch]


def train(model, optimizer, runner: OneProcess, tokens, batch: int, steps: int) -> list[float]:
    """Train `steps` steps; each step's seconds."""
    model.train()
    seconds = []
    for rows in batches(tokens, batch, steps):
        started = time.perf_counter()
        runner.train_step(model, optimizer, cross_entropy, rows[:, :-1], rows[:, 1:])
        seconds.append(time.perf_counter() - started)
    return seconds


@torch.no_grad()
def validation_loss(model, runner: OneProcess, tokens: torch.Tensor, batch: int = 64) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(tokens), batch):
        rows = tokens[start : start + batch]
        outputs = runner.forward(model, rows[:, :-1], rows[:, 1:])
        total += cross_entropy(outputs, rows[:, 1:]).item() * len(rows)
        count += len(rows)
    return total / count


def saved_bytes(state: dict[str, torch.Tensor]) -> int:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "weights.safetensors"
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path))
        return path.stat().st_size


def train_base(args, base_cfg):
    """The base: `--base-steps` AdamW steps on python-stdlib windows, fp32."""
    torch.manual_seed(base_cfg.training.seed)
    model = build_model(base_cfg.model)
    data = windows(base_cfg, args.context, seed=0)
    optimizer = build_optimizer(list(model.parameters()), "adamw", base_cfg.training.lr, 0.0)
    started = time.perf_counter()
    train(model, optimizer, OneProcess("fp32"), data["train"], args.batch, args.base_steps)
    base_loss = validation_loss(model, OneProcess("fp32"), data["validation"])
    print(
        f"base: {args.base_steps} steps in {time.perf_counter() - started:.0f} s, validation "
        f"loss on python-stdlib {base_loss:.3f}",
        flush=True,
    )
    return model.state_dict()


def finetune(name: str, base_state, ft_cfg, data, args, lr: float) -> tuple[dict, dict]:
    """One fine-tuning run from `base_state` at learning rate `lr`: its figures, and what it
    would register (the adapter alone, or the whole state dict)."""
    method, precision = RUNS[name]
    model = build_model(ft_cfg.model)
    model.load_state_dict(base_state)
    if method == "lora":
        apply_lora(model, ft_cfg.finetune)
    runner = OneProcess(precision)
    trainable = [p for p in model.parameters() if p.requires_grad]
    training = ft_cfg.training
    optimizer = build_optimizer(trainable, training.optimizer, lr, training.weight_decay)
    before = validation_loss(model, runner, data["validation"])
    torch.manual_seed(training.seed)
    seconds = train(model, optimizer, runner, data["train"], args.batch, args.steps)
    state = model_state_bytes(model, optimizer)  # the last step's gradients still held
    after = validation_loss(model, runner, data["validation"])
    artifact = adapter_state(model) if method == "lora" else model.state_dict()
    return {
        "lr": lr,
        "trainable_fraction": sum(p.numel() for p in trainable)
        / sum(p.numel() for p in model.parameters()),
        "state_bytes": sum(state.values()),
        **{f"{part}_bytes": value for part, value in state.items()},
        "samples_per_s": args.batch / statistics.median(seconds[WARMUP:]),
        "val_loss_before": before,
        "val_loss_after": after,
        "artifact_bytes": saved_bytes(artifact),
    }, artifact


def multi_adapter_vs_merged(base_state, ft_cfg, adapters: dict, data, args) -> dict:
    """Serving throughput of one base holding both LoRA adapters (every other request through
    each, decoded in the same batches: `raylane.models.multi_lora`) against one merged model
    answering the same requests: requests/s of a `GenerationEngine` with 8 cache slots, greedy,
    `REQUESTS` requests of a 16-byte prompt and up to 32 new bytes (medians of `REPEATS`,
    alternated). The adapted requests' text must equal the merged models' token for token."""

    def base():
        model = build_model(ft_cfg.model)
        model.load_state_dict(base_state)
        return model.eval()

    def merged(state):
        return merge_adapters(load_adapter(apply_lora(base(), ft_cfg.finetune), state)).eval()

    names = list(adapters)
    requests, repeats = (4, 1) if args.smoke else (REQUESTS, REPEATS)
    prompts = [
        data["validation"][i % len(data["validation"]), :16].tolist() for i in range(requests)
    ]
    params = SamplingParams(max_tokens=min(32, args.context - 16), temperature=0)
    scale = ft_cfg.finetune.alpha / ft_cfg.finetune.rank

    def serve(engine, rows):
        started = time.perf_counter()
        sequences = [engine.add(p, params, r) for p, r in zip(prompts, rows, strict=True)]
        while engine.busy:
            engine.step()
        return time.perf_counter() - started, [s.output for s in sequences]

    multi = GenerationEngine(base(), 8, max_adapters=len(names))
    for name in names:
        multi.adapters.add(name, adapters[name], scale)
    one = GenerationEngine(merged(adapters[names[0]]), 8)
    times = {"multi": [], "merged": []}
    for _ in range(repeats):
        keys = [names[i % len(names)] for i in range(requests)]
        seconds, outputs = serve(multi, [multi.adapters.acquire(k) for k in keys])
        times["multi"].append(seconds)
        seconds, merged_outputs = serve(one, [0] * requests)
        times["merged"].append(seconds)
    own = [o for o, k in zip(outputs, keys, strict=True) if k == names[0]]
    exact = own == [o for o, k in zip(merged_outputs, keys, strict=True) if k == names[0]]
    multi_rps = requests / statistics.median(times["multi"])
    merged_rps = requests / statistics.median(times["merged"])
    print(
        f"serving {requests} requests, 8 slots: {len(names)} adapters on one base "
        f"{multi_rps:.1f} req/s, one merged model {merged_rps:.1f} req/s; adapted text equal "
        f"to the merged model's: {exact}",
        flush=True,
    )
    return {
        "multi_adapter_vs_merged": round(multi_rps / merged_rps, 3),
        "multi_adapter_req_per_s": round(multi_rps, 2),
        "merged_req_per_s": round(merged_rps, 2),
        "multi_adapter_exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-steps", type=int, default=300, help="Base training steps.")
    parser.add_argument("--steps", type=int, default=100, help="Fine-tuning steps per run.")
    parser.add_argument("--context", type=int, default=64, help="Bytes per window.")
    parser.add_argument("--batch", type=int, default=16, help="Windows per step.")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    torch.set_num_threads(1)
    model = [f"model.input_dim={args.context}", f"training.batch_size={args.batch}"]
    model += SMOKE_CONFIG if args.smoke else []
    ft_cfg = load_config(ROOT / "configs" / "finetune" / "lm_lora.yaml", model)
    base_cfg = load_config(ROOT / "configs" / "train" / "lm_serve.yaml", model)
    fast, line = bf16_speed(use_gpu=False)
    print(line, flush=True)

    base_state = train_base(args, base_cfg)
    data = windows(ft_cfg, args.context, seed=ft_cfg.training.seed)
    results, artifacts = {}, {}
    for name in RUNS:
        # The bf16 run at the fp32 LoRA run's best learning rate.
        bf16 = name == "lora_bf16"
        rates = (results["lora"]["lr"],) if bf16 else LEARNING_RATES[RUNS[name][0]]
        rates = rates[:1] if args.smoke else rates
        tried = [finetune(name, base_state, ft_cfg, data, args, lr) for lr in rates]
        results[name], artifacts[name] = min(tried, key=lambda t: t[0]["val_loss_after"])
        losses = ", ".join(f"lr {t[0]['lr']:g}: {t[0]['val_loss_after']:.4f}" for t in tried)
        print(f"{name}: {args.steps} steps; validation loss after {losses}", flush=True)
    _print_table(results, args)
    full, lora, lora_bf16 = results["full"], results["lora"], results["lora_bf16"]
    figures = {
        "trainable_fraction": round(lora["trainable_fraction"], 4),
        "state_bytes_ratio": round(lora["state_bytes"] / full["state_bytes"], 4),
        "loss_ratio": round(lora["val_loss_after"] / full["val_loss_after"], 4),
        "adapter_bytes_ratio": round(lora["artifact_bytes"] / full["artifact_bytes"], 4),
        "bf16_loss_ratio": round(lora_bf16["val_loss_after"] / lora["val_loss_after"], 4),
        "bf16_speed_ratio": round(lora_bf16["samples_per_s"] / lora["samples_per_s"], 3),
        "bf16_fast": fast,
        **multi_adapter_vs_merged(
            base_state, ft_cfg, {n: artifacts[n] for n in ("lora", "lora_bf16")}, data, args
        ),
        "runs": {n: {k: round(v, 4) for k, v in r.items()} for n, r in results.items()},
    }
    print_last_line(figures, args.smoke)


def _print_table(results: dict, args) -> None:
    print(
        f"\n{args.steps} steps from one base, batch {args.batch}, context {args.context}, "
        "one torch thread"
    )
    print(
        f"{'run':<10} {'trainable':>9} {'state MB':>8} {'samples/s':>9} {'val before':>10} "
        f"{'val after':>9} {'artifact KB':>11}"
    )
    for name, r in results.items():
        print(
            f"{name:<10} {r['trainable_fraction']:>9.4f} {r['state_bytes'] / 2**20:>8.2f} "
            f"{r['samples_per_s']:>9.1f} {r['val_loss_before']:>10.4f} "
            f"{r['val_loss_after']:>9.4f} {r['artifact_bytes'] / 1024:>11.1f}"
        )


if __name__ == "__main__":
    main()
