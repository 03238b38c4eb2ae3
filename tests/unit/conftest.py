"""The shipped example checkpoint the configs name (`configs/train/llama_chat.yaml`): made once
by `tools/tiny_checkpoint.py`, as the README has users make it, so that every shipped config
and README command validates (a `model.pretrained` directory is read when a config loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.readme_blocks import ROOT

CHECKPOINT = ROOT / "checkpoints" / "tiny-llama"


@pytest.fixture(scope="session", autouse=True)
def shipped_checkpoint() -> Path:
    if not (CHECKPOINT / "model.safetensors").is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "tiny_checkpoint.py"), str(CHECKPOINT)],
            check=True, capture_output=True,
        )  # fmt: skip
    return CHECKPOINT
