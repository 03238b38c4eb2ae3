"""The package's layering (pyproject.toml's [tool.importlinter] contracts) holds: the layers'
order, a planner without torch, Ray or the code that runs on them, and serving and tracking
without the trainer."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"
PLAN = "plan: a pure planner, without torch, Ray or what runs on them"
SERVING = "serving, its engine and inference: no training code"
SERVING_LAYERS = "serving: the Serve application above its engine above inference"
TRACKING = "tracking: no training code"


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["include_external_packages"] is True  # else torch and ray are not checked
    return {contract["name"]: contract for contract in config["contracts"]}


def _lint(platform: Path, cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports over the package under `platform`, with the repository's contracts."""
    env = {**os.environ, "PYTHONPATH": str(platform)}
    return subprocess.run(
        [str(LINT), "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _copy_with(tmp_path: Path, additions: dict[str, str]) -> Path:
    """A copy of the package with `additions` appended to its modules (paths under raylane/)."""
    copy = tmp_path / "platform"
    subprocess.run(["cp", "-r", str(ROOT / "platform"), str(copy)], check=True)
    for name, text in additions.items():
        module = copy / "raylane" / name
        module.write_text((module.read_text() if module.exists() else "") + text)
    return copy


def test_the_layers_put_the_profile_between_tune_and_the_planner():
    layers = _contracts()["raylane layers"]["layers"]
    order = [layer.split(" ")[0] for layer in layers]
    assert order.index("raylane.tune") + 1 == order.index("raylane.profile")
    assert order.index("raylane.profile") + 1 == order.index("raylane.plan")
    assert order.index("raylane.profile") < order.index("raylane.train")


def test_the_forbidden_contracts_name_what_each_part_must_not_import():
    contracts = _contracts()
    plan = contracts[PLAN]
    assert (plan["type"], plan["source_modules"]) == ("forbidden", ["raylane.plan"])
    assert set(plan["forbidden_modules"]) == {
        "raylane.train", "raylane.serving", "raylane.tune", "raylane.profile", "raylane.parallel",
        "torch", "ray",
    }  # fmt: skip
    serving = contracts[SERVING]
    assert serving["type"] == "forbidden"
    assert serving["source_modules"] == ["raylane.serving"]  # the engine and inference with it
    assert serving["forbidden_modules"] == ["raylane.train"]
    inside = contracts[SERVING_LAYERS]
    assert (inside["containers"], inside["exhaustive"]) == (["raylane.serving"], True)
    assert inside["layers"][1:] == ["generation", "inference"]
    tracking = contracts[TRACKING]
    assert (tracking["type"], tracking["source_modules"]) == ("forbidden", ["raylane.tracking"])
    assert tracking["forbidden_modules"] == ["raylane.train"]


def test_every_contract_is_kept():
    done = _lint(ROOT / "platform", ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in _contracts():
        assert f"{name} KEPT" in done.stdout, name
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in done.stdout


def test_a_lower_layer_importing_a_higher_one_breaks_the_contracts(tmp_path):
    # The same contracts over a copy of the package in which tracking imports the trainer.
    copy = _copy_with(
        tmp_path, {"tracking/cluster.py": "\nfrom raylane.train import trainer  # noqa\n"}
    )
    done = _lint(copy, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "raylane layers BROKEN" in done.stdout
    assert f"{TRACKING} BROKEN" in done.stdout
    assert "raylane.tracking.cluster -> raylane.train.trainer" in done.stdout


def test_the_planner_importing_torch_ray_or_the_strategies_breaks_its_contract(tmp_path):
    # Imports inside functions count: the planner may not reach torch even lazily. The planner
    # importing the strategies and serving importing the train loop are allowed by the layers'
    # order, not by their own contracts. Inside serving, the engine may not import the Serve
    # application, and a new module must be given its layer.
    lazy = "\n\ndef _later():\n    import {}  # noqa\n"
    copy = _copy_with(
        tmp_path,
        {
            "plan/cost.py": lazy.format("torch"),
            "plan/ring.py": lazy.format("ray"),
            "plan/search.py": "\nfrom raylane.parallel import mesh  # noqa\n",
            "serving/guard.py": "\nfrom raylane.train import loop  # noqa\n",
            "serving/generation/engine.py": "\nfrom raylane.serving import metrics  # noqa\n",
            "serving/unplaced.py": "",
        },
    )
    done = _lint(copy, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{PLAN} BROKEN" in done.stdout and f"{SERVING} BROKEN" in done.stdout
    assert f"{SERVING_LAYERS} BROKEN" in done.stdout
    assert "raylane.serving.unplaced" in done.stdout  # not in any layer of the exhaustive ones
    assert "raylane layers KEPT" in done.stdout
    for line in (
        "raylane.plan.cost -> torch",
        "raylane.plan.ring -> ray",
        "raylane.plan.search -> raylane.parallel.mesh",
        "raylane.serving.guard -> raylane.train.loop",
        "raylane.serving.generation.engine -> raylane.serving.metrics",
    ):
        assert line in done.stdout, line


def test_the_import_graph_draws_the_layout_parts_and_their_order():
    sys.path.insert(0, str(ROOT / "tools"))
    from import_graph import LAYOUT, mermaid

    drawn = mermaid(LAYOUT)
    # parallelize applies the plan the model names (no model's plan imported by the parallel
    # layer); every reader of the layout reads one type, which reads the preset table alone.
    assert "raylane_parallel_parallelize --> raylane_models" not in drawn
    for reader in ("parallel_mesh", "plan_cost", "plan_measured", "plan_search", "plan_wrapped"):
        assert f"raylane_{reader} --> raylane_config_dims" in drawn, reader
    from_dims = [line.strip() for line in drawn.splitlines() if "raylane_config_dims -->" in line]
    assert from_dims == ["raylane_config_dims --> raylane_config_presets"]
    # The planner and the profile job read the wrapped blocks' names from one module.
    for reader in ("plan_measured", "profile_layouts"):
        assert f"raylane_{reader} --> raylane_plan_wrapped" in drawn, reader
    assert "raylane_plan_wrapped --> raylane_parallel" not in drawn
