"""The shipped example checkpoint the configs name (`configs/train/llama_chat.yaml`): made once
by `tools/tiny_checkpoint.py`, as the README has users make it, so that every shipped config
and README command validates (a `model.pretrained` directory is read when a config loads)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.readme_blocks import ROOT
from tests.unit.gloo import CheckFailed, on_gloo, run_checks

CHECKPOINT = ROOT / "checkpoints" / "tiny-llama"


TOOL = ROOT / "tools" / "tiny_checkpoint.py"
#: The sha256 of the tool that wrote the checkpoint: a changed tool rewrites it.
STAMP = CHECKPOINT / ".written-by"


@pytest.fixture(scope="session", autouse=True)
def shipped_checkpoint() -> Path:
    """Where the configs name it, in the checkout (ignored by git), as a user's is: written
    when missing or when `tools/tiny_checkpoint.py` changed since it was written."""
    digest = hashlib.sha256(TOOL.read_bytes()).hexdigest()
    fresh = (CHECKPOINT / "model.safetensors").is_file() and (
        STAMP.is_file() and STAMP.read_text() == digest
    )
    if not fresh:
        subprocess.run(
            [sys.executable, str(TOOL), str(CHECKPOINT)], check=True, capture_output=True
        )
        STAMP.write_text(digest)
    return CHECKPOINT


@pytest.fixture(scope="session")
def two_processes(request, tmp_path_factory):
    """`results(module, name)`: the per-rank results of check `name` of `module`'s
    `TWO_PROCESS_CHECKS`, from one 2-process gloo spawn for every collected module that has
    them (`tests.unit.gloo`); a check that raised fails the test with its traceback."""
    modules = sorted({
        item.module.__name__ for item in request.session.items
        if hasattr(getattr(item, "module", None), "TWO_PROCESS_CHECKS")
    })  # fmt: skip
    ranks = on_gloo(run_checks, 2, tmp_path_factory.mktemp("two_processes"), modules)

    def results(module: str, name: str) -> list:
        found = [rank_results[module, name] for rank_results in ranks]
        failed = [r for r in found if isinstance(r, CheckFailed)]
        if failed:
            pytest.fail(f"{module}:{name} raised on a worker:\n{failed[0]}", pytrace=False)
        return found

    return results
