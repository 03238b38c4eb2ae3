"""`raylane plan` as the other commands: `--config` and `--set` (`--model` still works), tables
that fit 80 columns, and a written config that holds only what differs from the defaults yet
loads back to the same resolved config. No Ray is started."""

import pytest
import yaml
from typer.testing import CliRunner

from raylane.cli import app
from raylane.config import RaylaneConfig, load_config
from raylane.config.loader import flatten, validate_config
from raylane.plan.hardware import load_cluster
from raylane.plan.report import changed_from_defaults
from raylane.plan.search import config_overrides, plan, workload_for

from .test_config import ROOT
from .test_plan import A100_4X8, GPT_1P3B

SHIPPED = [
    ROOT / "configs" / folder / f"{name}.yaml"
    for folder, name in [
        ("train", "digits_ddp"), ("train", "lm_fsdp"), ("train", "lm_pipeline"),
        ("train", "lm_3d"), ("train", "lm_serve"), ("train", "llama_chat"),
        ("finetune", "lm_lora"), ("plan", "gpt_1p3b"),
    ]
]  # fmt: skip


def _plan(tmp_path, *args: str, name: str = "plan.yaml"):
    out = tmp_path / name
    result = CliRunner().invoke(
        app, ["plan", "--cluster", str(A100_4X8), "--out", str(out), *args], env={"COLUMNS": "80"}
    )
    return result, out


def test_plan_takes_config_and_set_and_still_its_old_model_option(tmp_path):
    sets = ["--set", "training.batch_size=256", "--set", "training.precision=bf16"]
    new, written = _plan(tmp_path, "--config", str(GPT_1P3B), *sets)
    assert new.exit_code == 0, new.output
    assert "256 x 2048 tokens per step, bf16" in new.output  # the --set values were planned
    old, old_written = _plan(tmp_path, "--model", str(GPT_1P3B), *sets, name="old.yaml")
    assert old.exit_code == 0, old.output
    assert old_written.read_text() == written.read_text()
    both, _ = _plan(tmp_path, "-c", str(GPT_1P3B), "-m", str(GPT_1P3B))
    assert both.exit_code == 2
    assert both.output == "error: give --config or --model (its old name), not both\n"


@pytest.mark.parametrize("objective", ["time", "cost"])
def test_plan_tables_fit_80_columns_with_every_figure_whole(tmp_path, objective):
    result, _ = _plan(tmp_path, "--global-batch", "512", "--objective", objective)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.output  # no cell cut short to fit
    header = "compute  bubble  tp comm  dp comm  pp comm  cp comm"
    title = "where each step goes, s" if objective == "time" else "cost per epoch"
    assert any(line.strip() == title for line in lines)
    if objective == "time":
        assert any(line.endswith(header + " ") or line.endswith(header) for line in lines)
    rows = [line for line in lines if line[:3] in ("1  ", "5  ")]
    assert len(rows) == 4  # ranks 1 and 5 in both tables, each on one line


def test_the_written_config_holds_what_differs_and_loads_back_the_same(tmp_path):
    sets = ["--set", "training.batch_size=256"]
    result, written = _plan(tmp_path, "--config", str(GPT_1P3B), *sets)
    assert result.exit_code == 0, result.output
    text = written.read_text()
    assert "# Planned from" in text and "--set training.batch_size=256" in text
    tree = flatten(yaml.safe_load(text))
    defaults = flatten(RaylaneConfig(experiment="x").model_dump(mode="json"))
    same = [key for key, value in tree.items() if key in defaults and defaults[key] == value]
    # No field at its default but the layout's strategy and the precision it was predicted at.
    assert set(same) <= {"parallelism.strategy", "training.precision"}
    assert "training.precision" in tree
    assert len(tree) < len(defaults) / 3
    # The resolved config written in full before: the base, its --set, the winner's layout.
    cfg = load_config(GPT_1P3B, ["training.batch_size=256"])
    best = plan(workload_for(cfg, 256, "fp32"), load_cluster(A100_4X8)).ranked[0]
    work = workload_for(cfg, 256, "fp32")
    full = load_config(GPT_1P3B, ["training.batch_size=256", *config_overrides(best, work)])
    planned = load_config(written)
    assert planned.parallelism.use_gpu and planned.parallelism.workers == 32
    assert planned.model_dump() == full.model_dump()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_changed_from_defaults_validates_back_to_the_same_config(path):
    cfg = load_config(path)
    short = changed_from_defaults(cfg)
    assert validate_config(yaml.safe_load(yaml.safe_dump(short))).model_dump() == cfg.model_dump()
    assert len(flatten(short)) < len(flatten(cfg.model_dump(mode="json"))) / 2
