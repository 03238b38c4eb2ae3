"""Code, weights and environment digests; the check that stops a run on mixed code."""

from __future__ import annotations

import json

import pytest
import torch

from raylane.jobs import job_runtime_env
from raylane.tracking.identity import code_digest, package_dir, requirements, weights_digest
from raylane.train.loop import CODE_MISMATCH, check_same_code


def test_code_digest_changes_with_any_source_byte(tmp_path):
    for name in ("a.py", "sub/b.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    before = code_digest(tmp_path)
    assert code_digest(tmp_path) == before  # stable
    (tmp_path / "sub" / "b.py").write_text("x = 2\n")
    assert code_digest(tmp_path) != before
    (tmp_path / "sub" / "b.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")  # same bytes, other file
    assert code_digest(tmp_path) != before


def test_the_running_package_is_digested():
    assert package_dir().name == "raylane" and len(code_digest()) == 64


def test_weights_digest_sees_values_dtypes_and_names():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = model.state_dict()
    digest = weights_digest(state)
    assert weights_digest({k: v.clone() for k, v in state.items()}) == digest
    nudged = {k: v.clone() for k, v in state.items()}
    nudged["bias"][0] += 1e-7
    assert weights_digest(nudged) != digest
    assert weights_digest({k: v.double() for k, v in state.items()}) != digest
    assert weights_digest({f"m.{k}": v for k, v in state.items()}) != digest


def test_requirements_pin_this_environment():
    pinned = requirements().splitlines()
    assert any(line.startswith("torch==2.13.0") for line in pinned)
    names = [line.split("==")[0].lower() for line in pinned]
    assert names == sorted(names) and len(set(names)) == len(names)


def _rank(node: str, digest: str) -> dict:
    return {"node": node, "code_digest": digest, "code_path": f"/{node}/raylane"}


def test_mixed_code_stops_the_run_naming_each_side():
    check_same_code([_rank("n1", "a" * 64), _rank("n2", "a" * 64)])  # agreeing: no error
    with pytest.raises(RuntimeError, match=CODE_MISMATCH) as caught:
        check_same_code([_rank("n1", "a" * 64), _rank("n2", "b" * 64)])
    message = str(caught.value)
    assert "n1: aaaaaaaaaaaa at /n1/raylane" in message and "n2: bbbbbbbbbbbb" in message
    with pytest.raises(RuntimeError, match="driver: cccc"):
        check_same_code(
            [_rank("n1", "a" * 64)], {"code_digest": "c" * 64, "code_path": "/submitted"}
        )


def test_job_runtime_env_carries_store_code_path_and_commit(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not a git checkout: the commit comes from the environment
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAYLANE_GIT_COMMIT", "f" * 40)
    monkeypatch.setenv("RAYLANE_GIT_DIRTY", "0")
    env = job_runtime_env()["env_vars"]
    assert env["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path}/mlflow.db"
    assert env["PYTHONPATH"] == "platform"
    assert env["RAYLANE_GIT_COMMIT"] == "f" * 40 and env["RAYLANE_GIT_DIRTY"] == "0"
    json.dumps(env)
