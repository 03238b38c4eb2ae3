"""Every command block of README.md and the documentation site (docs/**/*.md), and the usage
lines they point to, checked without running them.

Runnable blocks are also executed from a fresh copy (tests/integration/test_readme_run.py);
this checks all of them, including those that need Docker or Kubernetes: each `raylane`
command parses with the real CLI and its config (with its `--set`s) validates, every script,
config and Makefile target it names exists, and the shell syntax is sound.
"""

from __future__ import annotations

import re
import shlex
import subprocess

import click
import pytest
import typer.main

from raylane.cli import app
from raylane.config import load_config
from raylane.tune.spec import is_search_spec, load_spec
from tests.readme_blocks import ROOT, read_blocks, split_command, usage_lines

BLOCKS = read_blocks()
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh")]
CLI = typer.main.get_command(app)
# Documented placeholders and the stand-ins a structural check uses for them.
PLACEHOLDERS = {
    "<run>": "digits-ddp-placeholder",
    "<old>": "1",
    "<new>": "2",
    "<run-id>": "0" * 32,
    "<other-run-id>": "1" * 32,
}


def _substitute(command: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    return command


def test_every_block_says_whether_it_runs():
    unmarked = [b.where for b in BLOCKS if not b.mode]
    assert not unmarked, f"blocks without a readme-test marker: {unmarked}"
    unexplained = [b.where for b in BLOCKS if b.mode == "skip" and not b.reason]
    assert not unexplained, f"skipped blocks must say why: {unexplained}"
    assert all(b.lang in ("bash", "sh", "python") for b in BLOCKS if b.mode == "run")


def test_placeholders_are_the_documented_ones():
    for block in SHELL:
        found = set(re.findall(r"<[a-z-]+>", block.text))
        assert found <= set(PLACEHOLDERS), f"{block.where}: undocumented placeholders {found}"


def test_the_readme_runs_more_than_it_skips():
    runnable = [b for b in SHELL if b.mode == "run"]
    assert len(runnable) >= 5, [b.where for b in runnable]


@pytest.mark.parametrize("block", SHELL, ids=[b.where for b in SHELL])
def test_block_is_valid_shell(block):
    text = _substitute(block.text)
    checked = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert checked.returncode == 0, f"{block.where}: {checked.stderr}"


def _raylane(argv: list[str], where: str) -> None:
    """Parse with the real CLI, then validate the config the command would load."""
    name, *rest = argv
    command = CLI.get_command(click.Context(CLI), name)
    assert command is not None, f"{where}: raylane has no command {name!r}"
    try:
        ctx = command.make_context(name, rest)
    except click.ClickException as exc:
        pytest.fail(f"{where}: raylane {' '.join(argv)}: {exc.format_message()}")
    config, sets = ctx.params.get("config"), ctx.params.get("overrides") or []
    if name == "plan":
        from raylane.plan.hardware import load_cluster

        model = config or ctx.params.get("model") or "configs/plan/gpt_1p3b.yaml"
        load_config(ROOT / model, sets)
        load_cluster(ROOT / ctx.params["cluster"])
        return
    if config is None:
        return
    assert (ROOT / config).is_file(), f"{where}: {config} does not exist"
    if name == "tune" or (name == "profile" and is_search_spec(ROOT / config)):
        load_spec(ROOT / config, sets)
    else:
        load_config(ROOT / config, sets)


def _pipeline_subcommand(script: str) -> str:
    match = re.search(r'app\(\["(\w+)"', (ROOT / script).read_text())
    assert match, f"{script} does not hand over to a raylane command"
    return match.group(1)


def check_command(command: str, where: str) -> None:
    argv = split_command(_substitute(command))
    if argv[0] == "raylane":
        _raylane(argv[1:], where)
    elif argv[:3] == ["ray", "job", "submit"]:
        assert "--" in argv, f"{where}: ray job submit without `--` before the entrypoint"
        check_command(shlex.join(argv[argv.index("--") + 1 :]), where)
    elif argv[0] == "python" and argv[1].startswith("pipelines/"):
        assert (ROOT / argv[1]).is_file(), f"{where}: {argv[1]} does not exist"
        _raylane([_pipeline_subcommand(argv[1]), *argv[2:]], where)
    elif argv[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert set(argv[1:]) <= set(targets), f"{where}: make {argv[1:]} not in {targets}"
    elif argv[0] == "serve" and argv[1] in ("run", "deploy"):
        assert (ROOT / argv[2]).is_file(), f"{where}: {argv[2]} does not exist"
    elif argv[:2] == ["docker", "compose"]:
        assert (ROOT / "docker-compose.yml").is_file()
    elif argv[0] == "cp":
        assert (ROOT / argv[1]).is_file(), f"{where}: {argv[1]} does not exist"
    elif argv[0] == "curl":
        urls = [a for a in argv if a.startswith("http")]
        assert urls and all(re.match(r"https?://(127\.0\.0\.1|localhost)[:/]", u) for u in urls)


@pytest.mark.parametrize("block", SHELL, ids=[b.where for b in SHELL])
def test_block_commands_parse_and_their_configs_validate(block):
    for command in block.commands():
        check_command(command, block.where)


USAGE_FILES = sorted(
    [*ROOT.glob("configs/train/*.yaml"), *ROOT.glob("configs/tune/*.yaml"),
     *ROOT.glob("configs/finetune/*.yaml"), *ROOT.glob("configs/plan/*.yaml"),
     *ROOT.glob("configs/clusters/*.yaml"),
     *ROOT.glob("pipelines/[!_]*.py"), ROOT / "serving" / "app.py"]
)  # fmt: skip


@pytest.mark.parametrize("path", USAGE_FILES, ids=[p.name for p in USAGE_FILES])
def test_usage_lines_at_the_top_of_configs_and_scripts_are_valid(path):
    lines = usage_lines(path)
    assert lines, f"{path.name} shows no usage line at its top"
    for line in lines:
        # `[--set ...]` marks an optional part: check the command with and without it.
        for variant in {re.sub(r"\s*\[(.*?)\]", r" \1", line), re.sub(r"\s*\[.*?\]", "", line)}:
            check_command(variant.removeprefix("RAY_AUTH_MODE=token "), f"{path.name}")
