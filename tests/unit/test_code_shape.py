"""The package's shape as its design states it: a strategy name is read in one table only,
modules and functions stay small, and raylane's own imports sit at the top of each module."""

import ast
from pathlib import Path
from typing import get_args

from raylane.config.parallelism import Strategy
from raylane.config.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "platform" / "raylane"
NAMES = set(get_args(Strategy))


def _modules(*folders: Path):
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _strategy_tests(tree: ast.AST) -> list[int]:
    """Lines that compare something with a strategy name (`x == 'fsdp'`, `x in ('tp', ...)`)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            if any(isinstance(i, ast.Constant) and i.value in NAMES for i in items):
                lines.append(node.lineno)
    return lines


def test_every_strategy_name_is_one_row_of_the_preset_table():
    assert set(PRESETS) == NAMES


def test_no_module_branches_on_a_strategy_name():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path, tree in _modules(PACKAGE)
        if path.name != "presets.py"
        for line in _strategy_tests(tree)
    ]
    assert found == []
