"""The package's layering (pyproject.toml's [tool.importlinter] contract) holds."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_layers_contract_is_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "raylane layers KEPT" in done.stdout
    assert "0 broken" in done.stdout


def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(tmp_path):
    # The same contract over a copy of the package in which tracking imports the trainer.
    copy = tmp_path / "platform"
    subprocess.run(["cp", "-r", str(ROOT / "platform"), str(copy)], check=True)
    module = copy / "raylane" / "tracking" / "cluster.py"
    module.write_text(module.read_text() + "\nfrom raylane.train import trainer  # noqa\n")
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(copy)}
    done = subprocess.run(
        [str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "raylane.tracking.cluster -> raylane.train.trainer" in done.stdout


def test_the_import_graph_draws_the_layout_parts_and_their_order():
    sys.path.insert(0, str(ROOT / "tools"))
    from import_graph import LAYOUT, mermaid

    drawn = mermaid(LAYOUT)
    # parallelize applies the model's own plan; every reader of the layout reads one type.
    assert "raylane_parallel_parallelize --> raylane_models_gpt_plan" in drawn
    for reader in ("parallel_mesh", "plan_cost", "plan_measured", "plan_search"):
        assert f"raylane_{reader} --> raylane_config_dims" in drawn, reader
    assert "raylane_config_dims -->" not in drawn  # the layout type imports none of them
