"""The command line's own behaviour: `--version`, how a wrong key is reported, each command's
`--set` example, and `validate` on a search spec. No Ray is started."""

import subprocess
import sys
from importlib.metadata import version

import pytest
import typer
import yaml
from typer.testing import CliRunner

from raylane.cli import app
from raylane.cli.planning import PLAN_CONFIG
from raylane.config import load_config
from raylane.tune.spec import load_spec

from .test_config import REFERENCE, ROOT

SEARCH_SPEC = ROOT / "configs" / "tune" / "parallelism.yaml"


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands' default configs are relative to the repository
    return CliRunner()


def test_version_names_raylane_and_what_it_runs_on(runner):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"raylane {version('raylane')} (ray {version('ray')}, torch {version('torch')}, "
        f"mlflow {version('mlflow')})\n"
    )


def test_version_imports_neither_torch_nor_ray_nor_mlflow():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from raylane.cli import app\n"
        "result = CliRunner().invoke(app, ['--version'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in ('torch', 'ray', 'mlflow') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]"


def test_a_subcommand_keeps_its_own_version_option(runner):
    result = runner.invoke(app, ["deploy", "--help"])
    assert result.exit_code == 0
    assert "Registry version to serve" in result.stdout


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "training.epoch=3",
            "--set training.epoch=3: unknown key training.epoch (did you mean training.epochs?)",
        ),
        (
            "serving.draft_model=tiny",
            "--set serving.draft_model=tiny: unknown key serving.draft_model (did you mean "
            "serving.generation.draft_model?)",
        ),
        (
            "trainig.epochs=3",
            "--set trainig.epochs=3: unknown key trainig (did you mean training or tracking?)",
        ),
        ("training.zzzzqq=1", "--set training.zzzzqq=1: unknown key training.zzzzqq"),
    ],
)
def test_unknown_set_key_blames_the_override_and_suggests(runner, override, line):
    result = runner.invoke(app, ["validate", "--config", str(REFERENCE), "--set", override])
    assert result.exit_code == 2
    assert result.output == f"error: {line}\n"  # one line, and not the file's fault


def test_typo_in_the_file_names_the_file_and_suggests(runner, tmp_path):
    tree = yaml.safe_load(REFERENCE.read_text())
    tree["training"]["epoch"] = tree["training"].pop("epochs", 3)
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(tree))
    result = runner.invoke(app, ["validate", "--config", str(path)])
    assert result.exit_code == 2
    assert (
        f"error: {path}: training.epoch: unknown key (did you mean training.epochs?)"
        in result.output
    )
    assert "--set" not in result.output


def test_a_file_typo_and_an_override_typo_are_each_blamed(tmp_path):
    tree = yaml.safe_load(REFERENCE.read_text())
    tree["serving"]["prot"] = 8001
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ValueError) as caught:
        load_config(path, ["training.lrr=0.1"])
    assert str(caught.value) == (
        "--set training.lrr=0.1: unknown key training.lrr (did you mean training.lr?); "
        f"{path}: serving.prot: unknown key (did you mean serving.port?)"
    )


def _set_help(command: str) -> tuple[str, object]:
    """The `--set` help of `command`, and its `--config` default (plan's is in its help)."""
    group = typer.main.get_command(app)
    params = {param.name: param for param in group.commands[command].params}
    return params["overrides"].help, params["config"].default or PLAN_CONFIG


@pytest.mark.parametrize(
    ("command", "example"),
    [
        ("validate", "training.epochs=3"),
        ("prepare", "training.epochs=3"),
        ("train", "training.epochs=3"),
        ("finetune", "training.epochs=3"),
        ("quickstart", "training.epochs=3"),
        ("profile", "training.epochs=3"),
        ("plan", "training.batch_size=512"),
        ("tune", "trial.epochs=3"),
        ("deploy", "serving.port=8001"),
        ("generate", "serving.port=8001"),
        ("promote", "serving.port=8001"),
        ("status", "serving.port=8001"),
    ],
)
def test_each_commands_set_example_is_valid_for_it(monkeypatch, command, example):
    monkeypatch.chdir(ROOT)
    help_text, default_config = _set_help(command)
    assert help_text == f"Override a field: --set {example} (repeatable)."
    if command == "tune":
        assert load_spec(default_config, [example]).trial.epochs == 3
    else:
        cfg = load_config(default_config, [example])
        section, key = example.split("=")[0].split(".")
        assert getattr(getattr(cfg, section), key) == int(example.split("=")[1])


def test_validate_prints_a_search_spec(runner):
    result = runner.invoke(
        app, ["validate", "--config", str(SEARCH_SPEC), "--set", "trial.epochs=4"]
    )
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert printed["base"] == "configs/train/lm_pipeline.yaml"
    assert printed["trial"]["epochs"] == 4
    assert printed["predict"]["top_k"] >= 1  # defaults filled in
    assert "unknown key" not in result.output


def test_validate_reports_a_search_specs_own_mistake(runner):
    result = runner.invoke(
        app, ["validate", "--config", str(SEARCH_SPEC), "--set", "trial.epoch=3"]
    )
    assert result.exit_code == 2
    assert (
        "error: --set trial.epoch=3: unknown key trial.epoch (did you mean trial.epochs?)"
        in result.output
    )
