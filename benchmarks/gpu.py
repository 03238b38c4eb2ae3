"""raylane on one GPU, with torch (and `transformers` for the peer) alone: no Ray, MLflow or
pydantic needed, so it runs on a GPU machine that has only the CUDA build of torch.

What it measures, each figure the median of `--repeats` timing windows after warm-up, every
timing closed by a device synchronize:

- **training**: raylane's own training step (`StrategyDefaults.train_step`, the optimizer
  `build_optimizer` builds, the loop's loss) on a GPT of d 768 x 12 layers x 12 heads, T 1024,
  batch 32 (86M parameters): bf16 autocast eager and with `training.compile` (each block
  compiled, `raylane.parallel.compile`), fp32 and `precision: tf32`: tokens/s, MFU (6N plus
  attention FLOPs per token over the device's dense bf16 peak) and peak device memory;
- **cost model** (when pydantic is importable: `raylane.plan` validates its catalog with it):
  the predicted step time and peak memory of the bf16 eager step against the measured ones;
- **LoRA**: a step of LoRA (`raylane.models.adapters`) against a full fine-tuning step of a
  25.6M GPT at batch 64 x 256;
- **generation** on the trained 86M model: the engine's ms per token at batch 1 and tokens/s
  at 32 concurrent sequences, fp32 and bf16, beside `transformers` `generate()` on the same
  weights and GPU; speculative decoding with a small draft at batch 1; int8 and bf16 weight
  bytes and bits per byte; greedy tokens across the no-cache, cache and HF paths (fp32).

The models learn a little of the standard library's source first (on the device, in the
training section), so the draft has something to agree with and bits per byte mean something.

The last line printed is one JSON object. `--small` runs the same code at toy sizes (the suite
runs it that way on CPU so it cannot rot).

    python benchmarks/gpu.py [--device cuda] [--repeats 3] [--small] [--no-compile] [--smoke]

`--smoke` is `--small --repeats 1 --no-compile`, on the CPU where there is no CUDA device (it
says so in a line and in the last line's `cuda`): the CPU-capable part, every section at toy
sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT / "benchmarks")]

from harness import add_smoke_flag, print_last_line  # noqa: E402

from raylane.models.adapters import apply_lora  # noqa: E402
from raylane.models.gpt import GPT  # noqa: E402
from raylane.models.losses import cross_entropy  # noqa: E402
from raylane.models.optim import build_optimizer  # noqa: E402
from raylane.parallel.base import StrategyDefaults  # noqa: E402
from raylane.parallel.device import synchronize  # noqa: E402
from raylane.parallel.parallelize import apply_compile  # noqa: E402
from raylane.parallel.precision import apply_matmul_precision  # noqa: E402

try:  # the cost model validates its catalog with pydantic, which a bare GPU machine may lack
    from raylane.models.shape import DecoderShape  # noqa: E402
    from raylane.plan.cost import Layout, Workload, predict  # noqa: E402
    from raylane.plan.hardware import catalog_cluster  # noqa: E402
except ImportError as exc:
    COST_MODEL_MISSING: str | None = str(exc)
else:
    COST_MODEL_MISSING = None

#: Dense bf16 TFLOP/s by device name (the catalog's figures: configs/hardware/catalog.yaml).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0}
SIZES = {
    "full": {
        "train": dict(d_model=768, n_layers=12, n_heads=12, context=1024, batch=32),
        "lora": dict(d_model=512, n_layers=8, n_heads=8, context=256, batch=64),
        "draft": dict(d_model=256, n_layers=2, n_heads=4),
        "steps": 10, "learn_steps": 150, "new_tokens": 128, "concurrent": 32,
    },
    "small": {
        "train": dict(d_model=64, n_layers=2, n_heads=4, context=64, batch=4),
        "lora": dict(d_model=64, n_layers=2, n_heads=4, context=32, batch=4),
        "draft": dict(d_model=32, n_layers=1, n_heads=2),
        "steps": 2, "learn_steps": 4, "new_tokens": 8, "concurrent": 4,
    },
}  # fmt: skip
WARMUP = 3
#: configs/hardware/catalog.yaml's entry for a device name.
CATALOG_KEYS = {"H200": "h200-141gb", "H100": "h100-80gb", "A100": "a100-80gb", "L4": "l4-24gb"}


class OneDevice(StrategyDefaults):
    """raylane's training step on one device, no process group."""

    def __init__(self, device: torch.device, precision: str):
        self.device, self.precision = device, precision
        self.last_step_parts: dict[str, float] = {}


def fp32_matmuls() -> None:
    """torch's defaults back (fp32 matmuls in full fp32) after a tf32 mode."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True  # torch's default for convolutions
    torch.set_float32_matmul_precision("highest")


def median_step_s(step, steps: int, repeats: int, device: torch.device) -> float:
    """Median over `repeats` windows of `steps` calls of the seconds one call takes."""
    for _ in range(WARMUP):
        step()
    windows = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        windows.append((time.perf_counter() - started) / steps)
    return statistics.median(windows)


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's top-level modules (text every Python has)."""
    root, chunks, total = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for path in sorted(root.glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batch_sampler(text: torch.Tensor, batch: int, context: int, device: torch.device, seed=0):
    """A function drawing `batch` random windows of `context` bytes (inputs, next-byte targets)
    from `text`, already on `device`."""
    text = text.to(device)
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw():
        starts = torch.randint(
            len(text) - context - 1, (batch,), device=device, generator=generator
        )
        index = starts[:, None] + torch.arange(context + 1, device=device)
        rows = text[index]
        return rows[:, :-1], rows[:, 1:]

    return draw


def build_gpt(shape: dict, context: int, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(256, context, shape["d_model"], shape["n_heads"], shape["n_layers"])
    return model.to(device)


def flops_per_token(model: GPT, context: int) -> float:
    """Training FLOPs per token: 6N for the weights plus attention's 12 x layers x d x T
    (PaLM's appendix B), the figure MFU is quoted in."""
    n = sum(p.numel() for p in model.parameters())
    d_model = model.tok_emb.embedding_dim
    return 6 * n + 12 * len(model.blocks) * d_model * context


def train_figures(model, strategy, draw, steps, repeats, device, peak_tflops) -> dict:
    """Time raylane's training step on `model`; tokens/s, MFU and peak device memory."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, "adamw", 3e-4, 0.01)
    inputs, targets = draw()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loss = None

    def step():
        nonlocal loss, inputs, targets
        loss = strategy.train_step(model, optimizer, cross_entropy, inputs, targets)
        inputs, targets = draw()

    step_s = median_step_s(step, steps, repeats, device)
    tokens = inputs.numel()
    found = {
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "loss": float(loss),
        "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    }
    if peak_tflops:
        found["mfu"] = (
            tokens / step_s * flops_per_token(model, inputs.shape[1]) / peak_tflops / 1e12
        )
    return found


def training_section(args, size, device, peak_tflops, draw) -> tuple[dict, GPT]:
    """fp32, tf32, bf16 compiled, then bf16 eager: the model generation decodes later (trained
    for `learn_steps` more), measured last so that no other mode's peak memory holds it."""
    shape, context = size["train"], size["train"]["context"]
    found = {}
    modes = [("fp32", "fp32", False)]
    if device.type == "cuda":
        modes.append(("tf32", "tf32", False))
    if not args.no_compile:
        modes.append(("bf16_compiled", "bf16", True))
    modes.append(("bf16_eager", "bf16", False))
    for name, precision, compiled in modes:
        model = build_gpt(shape, context, device)
        fp32_matmuls()
        apply_matmul_precision(precision)
        if compiled:
            apply_compile(model)
        strategy = OneDevice(device, precision)
        found[name] = train_figures(
            model, strategy, draw, size["steps"], args.repeats, device, peak_tflops
        )
        fp32_matmuls()
        print(f"train {name}: {found[name]}", flush=True)
    found["compile_speedup"] = _ratio(found, "bf16_compiled", "bf16_eager")
    found["tf32_speedup"] = _ratio(found, "tf32", "fp32")
    model.zero_grad(set_to_none=True)
    return found, model


def _ratio(found: dict, a: str, b: str) -> float | None:
    if a in found and b in found:
        return found[a]["tokens_per_s"] / found[b]["tokens_per_s"]
    return None


def learn(model, draw, steps: int, device, precision="bf16", lr=1e-3) -> float:
    """A few hundred steps on standard-library text, so decoding has something to say."""
    strategy = OneDevice(device, precision)
    optimizer = build_optimizer(list(model.parameters()), "adamw", lr, 0.0)
    loss = torch.zeros((), device=device)
    for _ in range(steps):
        loss = strategy.train_step(model, optimizer, cross_entropy, *draw())
    return float(loss)


def cost_model_section(model: GPT, measured: dict, batch: int, context: int) -> dict:
    """The cost model's step time and peak memory for the bf16 eager step on this GPU (its
    catalog entry, one device), beside the measured ones."""
    if COST_MODEL_MISSING is not None:  # pydantic is not on this machine
        return {"skipped": f"the cost model needs pydantic ({COST_MODEL_MISSING})"}
    name = torch.cuda.get_device_name()
    key = next((k for k in CATALOG_KEYS if k in name), None)
    if key is None:
        return {"skipped": f"no catalog entry for {name}"}
    d_model = model.tok_emb.embedding_dim
    heads = d_model // model.blocks["0"].attn.head_dim
    shape = DecoderShape.gpt(256, context, d_model, len(model.blocks), heads)
    work = Workload(shape, global_batch=batch, precision="bf16")
    predicted = predict(work, Layout.of("ddp", dp=1), catalog_cluster(CATALOG_KEYS[key]))
    predicted_mb = predicted.memory_bytes / 2**20
    return {
        "predicted_step_ms": predicted.step_s * 1e3,
        "measured_step_ms": measured["step_ms"],
        "step_ratio": predicted.step_s * 1e3 / measured["step_ms"],
        "predicted_peak_mb": predicted_mb,
        "measured_peak_mb": measured["peak_mb"],
        "memory_ratio": predicted_mb / measured["peak_mb"],
    }


def lora_section(args, size, device, text) -> dict:
    """A LoRA step against a full fine-tuning step at the same batch (bf16)."""
    shape = size["lora"]
    draw = batch_sampler(text, shape["batch"], shape["context"], device, seed=1)
    found = {}
    for name in ("full", "lora"):
        model = build_gpt(shape, shape["context"], device)
        if name == "lora":
            adapters = SimpleNamespace(rank=8, alpha=16, dropout=0.0, target_modules=["q", "v"])
            apply_lora(model, adapters)
        found[name] = train_figures(
            model, OneDevice(device, "bf16"), draw, size["steps"], args.repeats, device, None
        )
        print(f"finetune {name}: {found[name]}", flush=True)
    found["lora_over_full_step"] = found["lora"]["step_ms"] / found["full"]["step_ms"]
    return found


def generation_section(args, size, device, model: GPT, text: torch.Tensor) -> dict:
    """Teach the model (and a small draft) some standard-library source, then decode."""
    from gpu_decode import generation_figures

    context = size["train"]["context"]
    draw = batch_sampler(text, size["train"]["batch"], context, device, seed=2)
    found = {"model_loss": learn(model, draw, size["learn_steps"], device)}
    draft = build_gpt(size["draft"], context, device, seed=3)
    found["draft_loss"] = learn(draft, draw, 2 * size["learn_steps"], device, lr=3e-3)
    print(f"learned: {found}", flush=True)
    found.update(generation_figures(model, draft, text, size, args.repeats, device))
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="toy sizes (a CPU smoke run)")
    parser.add_argument("--no-compile", action="store_true", help="skip training.compile")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.small, args.repeats, args.no_compile = True, 1, True
        if not torch.cuda.is_available():
            print("no CUDA device: the CPU-capable part at toy sizes (figures mean nothing)")
            args.device = "cpu"
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    size = SIZES["small" if args.small else "full"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)
    print(f"device: {name} (torch {torch.__version__}); dense bf16 peak {peak} TFLOP/s", flush=True)
    text = stdlib_bytes(4_000_000 if not args.small else 200_000)
    shape = size["train"]
    draw = batch_sampler(text, shape["batch"], shape["context"], device)
    result: dict = {"device": name, "torch": torch.__version__, "small": args.small}
    result["cuda"] = device.type == "cuda"
    result["train"], model = training_section(args, size, device, peak, draw)
    if device.type == "cuda":
        result["cost_model"] = cost_model_section(
            model, result["train"]["bf16_eager"], shape["batch"], shape["context"]
        )
    result["lora"] = lora_section(args, size, device, text)
    result["generation"] = generation_section(args, size, device, model, text)
    print_last_line(result, args.smoke, default=_rounded)
    return result


def _rounded(value):
    return str(value)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
