"""`benchmarks/gpu.py` runs where only torch (and transformers, peft) are installed: a GPU
machine often has the CUDA build of torch and nothing of Ray, MLflow or pydantic. Here it runs
at toy sizes on the CPU with those packages hidden, to its last line, so it cannot rot between
the runs on a GPU."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What a bare GPU machine lacks (torchao too: its int8 figures say so and are skipped).
ABSENT = ("ray", "mlflow", "pydantic", "pydantic_core", "fastapi", "torchao", "pyarrow")

RUN = f"""
import runpy, sys
for name in {ABSENT!r}:
    sys.modules[name] = None  # `import name` raises ImportError, find_spec says None
sys.argv = ["gpu.py", "--small", "--device", "cpu", "--repeats", "1", "--no-compile"]
runpy.run_path({str(ROOT / "benchmarks" / "gpu.py")!r}, run_name="__main__")
for name in {ABSENT!r}:
    assert sys.modules.get(name) is None, name + " was imported"
"""


def test_gpu_check_runs_to_its_last_line_without_ray_mlflow_or_pydantic():
    done = subprocess.run(
        [sys.executable, "-c", RUN], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    train = result["train"]
    assert train["bf16_eager"]["tokens_per_s"] > 0 and train["fp32"]["tokens_per_s"] > 0
    assert result["lora"]["lora_over_full_step"] > 0
    generation = result["generation"]
    # The paths decode the same greedy tokens in fp32 (no cache, cache, transformers).
    assert generation["greedy_same_every_path"] is True  # dynamic and static steps, CPU
    assert generation["fp32_dynamic"]["same_as_hf_batch"] is True
    assert generation["fp32_static"]["same_as_hf_batch"] is True
    assert generation["speculative"]["same_as_plain"] is True
    assert generation["weights"]["bf16_bytes"] < generation["weights"]["fp32_bytes"]
    assert generation["weights"]["int8"].startswith("skipped: torchao")
