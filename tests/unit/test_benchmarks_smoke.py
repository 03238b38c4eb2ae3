"""Every benchmark that needs no Ray runs in its smoke mode (`--smoke`: its real code path once,
at toy sizes) to its last line, which must be the JSON object it reports, marked smoke, with its
keys and types: a benchmark cannot break silently between the runs that measure.

`gpu.py` runs as a machine with only torch (and transformers, peft) would run it: Ray, MLflow
and pydantic hidden. The benchmarks that need Ray: tests/integration/test_benchmarks_smoke.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
#: What a bare GPU machine lacks (torchao too: its int8 figures say so and are skipped).
ABSENT = ("ray", "mlflow", "pydantic", "pydantic_core", "fastapi", "torchao", "pyarrow")
GPU_WITHOUT_RAY = f"""
import runpy, sys
for name in {ABSENT!r}:
    sys.modules[name] = None  # `import name` raises ImportError, find_spec says None
sys.path.insert(0, {str(BENCHMARKS)!r})
sys.argv = ["gpu.py", "--smoke"]
runpy.run_path({str(BENCHMARKS / "gpu.py")!r}, run_name="__main__")
for name in {ABSENT!r}:
    assert sys.modules.get(name) is None, name + " was imported"
"""


def smoke_line(command: list[str], cwd: Path, timeout_s: float) -> dict:
    """Run `command` with no Ray cluster to join and no GPU (the smoke is the CPU path, on a
    GPU machine too); its last line, which must be smoke JSON."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["smoke"] is True  # smoke figures can never pass for measurements
    return last


def finetune(last: dict) -> None:
    assert 0 < last["trainable_fraction"] < 1  # LoRA trains a fraction of the weights
    assert 0 < last["state_bytes_ratio"] < 1 and 0 < last["adapter_bytes_ratio"] < 1
    assert isinstance(last["bf16_fast"], bool) and last["bf16_speed_ratio"] > 0
    # Adapters served on one base decode what the merged model decodes, token for token.
    assert last["multi_adapter_exact"] is True
    assert set(last["runs"]) == {"full", "lora", "lora_bf16"}


def long_context(last: dict) -> None:
    # Each of 2 context-parallel workers holds half the sequence's activations (plus the
    # model's own): below one worker's, as sequence parallelism is below plain tp.
    assert 0 < last["cp2_activation_ratio"] < 1
    assert 0 < last["sp_activation_ratio"] < 1
    assert last["cp4_activation_ratio"] is None and last["max_len_gain"] is None  # not run
    assert set(last["peak_mb"]) == {"cp1_T64", "cp2_T64"}


def generate_load(last: dict) -> None:
    assert last["greedy_identical"] is True  # no cache, KV cache, transformers, speculative
    assert last["weights"].startswith("fresh weights") and last["kv_tokens_per_s"] > 0
    assert 0 < last["int8_bytes_ratio"] < 1
    # Untrained weights: the figures that depend on them are left out, never reported.
    for key in ("fp32_bpb", "int8_bpb_delta", "spec_acceptance", "lookup_acceptance"):
        assert last[key] is None, key
    assert last["static"]["tokens_per_s"] > 0 and last["continuous"]["tokens_per_s"] > 0


def gpu(last: dict) -> None:
    assert last["cuda"] is False and last["small"] is True  # CUDA hidden: the CPU part
    train = last["train"]
    assert train["bf16_eager"]["tokens_per_s"] > 0 and train["fp32"]["tokens_per_s"] > 0
    assert last["lora"]["lora_over_full_step"] > 0
    generation = last["generation"]
    # The paths decode the same greedy tokens in fp32 (no cache, cache, transformers).
    assert generation["greedy_same_every_path"] is True  # dynamic and static steps, CPU
    assert generation["fp32_dynamic"]["same_as_hf_batch"] is True
    assert generation["fp32_static"]["same_as_hf_batch"] is True
    assert generation["speculative"]["same_as_plain"] is True
    assert generation["weights"]["bf16_bytes"] < generation["weights"]["fp32_bytes"]
    assert generation["weights"]["int8"].startswith("skipped: torchao")


def real_size(last: dict) -> None:
    # The loss in 1 MB chunks of the smoke's 16 MB logits: the same loss and adapter gradients.
    assert last["chunk_mb"] == 1.0 and last["logits_mb_per_copy"] == 16.0
    assert last["loss_diff"] <= 1e-6 and last["grad_diff"] <= 1e-6
    assert last["whole_peak_mb"] > 0 and last["chunked_peak_mb"] > 0
    assert last["recomputed_peak_mb"] > 0 and last["recomputed_grad_diff"] <= 1e-6
    # The base built in bf16 (rounded values): a near loss, not an equal one.
    assert last["bf16_base_peak_mb"] > 0 and 0 < last["bf16_base_loss_diff"] < 1e-2
    assert last["lean_peak_mb"] > 0 and last["lean_loss_diff"] == 0.0  # the allocator only


def smoke(name: str) -> list[str]:
    return [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke"]


CASES = {
    "finetune": (smoke("finetune"), finetune),
    "long_context": (smoke("long_context"), long_context),
    "generate_load": (smoke("generate_load"), generate_load),
    "real_size": (smoke("real_size"), real_size),
    "gpu": ([sys.executable, "-c", GPU_WITHOUT_RAY], gpu),
}


@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_smoke_runs_to_its_json_line(name, tmp_path):
    command, check = CASES[name]
    check(smoke_line(command, tmp_path, timeout_s=180))
