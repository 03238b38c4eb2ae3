"""`training.precision: tf32`: a GPU matmul mode the worker switches on, refused on a CPU run
in one line, and what `raylane plan --precision tf32` writes into the config it predicted."""

from __future__ import annotations

import pytest
import torch
import yaml

from raylane.config import ConfigError, load_config
from raylane.parallel.precision import apply_matmul_precision, autocast, fsdp_mixed_precision
from raylane.plan.hardware import load_cluster
from raylane.plan.report import write_config
from raylane.plan.search import plan, workload_for

from .test_plan import A100_4X8, GPT_1P3B
from .test_precision import LM


def test_tf32_on_a_cpu_run_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as raised:
        load_config(LM, ["training.precision=tf32"])
    message = str(raised.value)
    assert message.startswith(f"{LM}: ") and "\n" not in message
    assert "training.precision 'tf32'" in message and "parallelism.use_gpu: true" in message


def test_tf32_on_a_gpu_run_is_recorded():
    cfg = load_config(LM, ["training.precision=tf32", "parallelism.use_gpu=true"])
    assert cfg.training.precision == "tf32"


@pytest.fixture
def restored_matmul_mode():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_other_precisions_leave_torchs_matmul_mode(restored_matmul_mode, precision):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    apply_matmul_precision(precision)
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"


def test_tf32_turns_on_the_gpus_tf32_matmuls_and_nothing_else(restored_matmul_mode):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    apply_matmul_precision("tf32")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"
    # fp32 tensors: no autocast, no FSDP mixed-precision policy
    assert isinstance(autocast("tf32", "cuda"), type(autocast("fp32", "cuda")))
    assert fsdp_mixed_precision("tf32") is None


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp32"])
def test_plan_writes_the_precision_it_predicted_with(tmp_path, precision):
    cfg = load_config(GPT_1P3B)
    work = workload_for(cfg, 64, precision)
    result = plan(work, load_cluster(A100_4X8))
    written = write_config(GPT_1P3B, result, tmp_path / "planned.yaml")
    tree = yaml.safe_load(written.read_text())
    assert tree["training"]["precision"] == precision
    assert tree["parallelism"]["use_gpu"] is True
    assert load_config(written).training.precision == precision
