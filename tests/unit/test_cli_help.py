"""`raylane --help` groups the commands in panels, `raylane util` holds the helpers (their old
names still run, unlisted), and every command's help reads well at 80 columns with an example
of its own, without importing torch, Ray or MLflow. No Ray is started."""

import importlib
import inspect
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from raylane.cli import COMMANDS, app

from .test_config import ROOT

PANELS = {
    "Data": ["validate", "prepare"],
    "Training": ["train", "finetune", "quickstart"],
    "Planning": ["tune", "plan", "profile"],
    "Serving": ["deploy", "generate", "promote", "status", "undeploy"],
    "Runs & models": ["runs", "models", "logs", "compare", "reproduce", "import", "export"],
    "Utilities": ["util"],
}
HELPERS = ["runtime-env", "serve-env"]


def _invoke(*args: str):
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def _panels(help_text: str) -> dict[str, list[str]]:
    """Each `╭─ Title ─` panel of a help screen: the first word of each row."""
    panels, current = {}, None
    for line in help_text.splitlines():
        title = re.match(r"╭─ (.+?) ─", line)
        if title:
            current = panels.setdefault(title.group(1), [])
        elif current is not None and line.startswith("│ "):
            current.append(line[2:].split(" ", 1)[0])
    return panels


def test_help_groups_the_commands_in_panels_one_line_each():
    text = _invoke("--help")
    panels = _panels(text)
    assert list(panels) == ["Options", *PANELS]  # in this order, and no other panel
    for title, commands in PANELS.items():
        assert panels[title] == commands, title  # one row each: no help wraps at 80 columns
    assert all(len(line) <= 80 for line in text.splitlines())
    for helper in HELPERS:
        assert all(helper not in rows for rows in panels.values())  # hidden, still runs


def test_util_lists_the_helpers_and_both_names_run():
    assert _panels(_invoke("util", "--help"))["Commands"] == HELPERS
    assert _invoke("util", "serve-env") == _invoke("serve-env")
    assert _invoke("util", "serve-env", "--ingress", "proxy").startswith("export ")
    new, old = _invoke("util", "runtime-env"), _invoke("runtime-env")
    assert new == old and '"env_vars"' in new


def _commands(entries=COMMANDS, prefix="raylane"):
    """(full name, function) of every listed command, util's included."""
    for entry in entries:
        if entry.commands:
            yield from _commands(entry.commands, f"{prefix} {entry.name}")
        elif not entry.hidden:
            module, function = entry.function.split(":")
            yield f"{prefix} {entry.name}", getattr(importlib.import_module(module), function)


LISTED = list(_commands())


@pytest.mark.parametrize(("name", "function"), LISTED, ids=[name for name, _ in LISTED])
def test_each_commands_help_fits_80_columns_with_an_example(name, function):
    summary, *details = inspect.cleandoc(function.__doc__).split("\n\n")
    assert "\n" not in summary and len(summary) <= 78, summary  # one line under the usage
    # Typer keeps the later paragraphs' line breaks: a line over 78 would wrap mid-sentence.
    assert [line for part in details for line in part.splitlines() if len(line) > 78] == []
    example = [part for part in details if part.startswith("Example: ")]
    assert len(example) == 1 and name.removeprefix("raylane ") in example[0], name
    shown = _invoke(*name.split()[1:], "--help")
    assert summary in shown and example[0].splitlines()[0] in shown
    assert all(len(line) <= 80 for line in shown.splitlines())


def test_no_help_imports_torch_ray_or_mlflow():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from raylane.cli import app, COMMANDS\n"
        "names = [[c.name] for c in COMMANDS] + [['util', 'serve-env'], ['util', 'runtime-env']]\n"
        "for name in [[], *names]:\n"
        "    result = CliRunner().invoke(app, [*name, '--help'])\n"
        "    assert result.exit_code == 0, (name, result.output)\n"
        "print(sorted(m for m in ('torch', 'ray', 'mlflow') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]"
