"""The package's shape as its design states it: a strategy name is read in one table only,
modules and functions stay small, and raylane's own imports sit at the top of each module."""

import ast
from pathlib import Path
from typing import get_args

from raylane.config.parallelism import Strategy
from raylane.config.presets import PRESETS

from .test_config import ROOT

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


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_modules_and_functions_stay_small():
    """Modules of at most 400 lines and functions of at most 60, benchmarks included."""
    long_modules, long_functions = [], []
    for path, tree in _modules(PACKAGE, ROOT / "benchmarks"):
        lines = path.read_text().count("\n")
        if lines > 400:
            long_modules.append(f"{path.relative_to(ROOT)}: {lines} lines")
        long_functions += [
            f"{path.relative_to(ROOT)}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
            for f in _functions(tree)
            if f.end_lineno - f.lineno + 1 > 60
        ]
    assert long_modules == [] and long_functions == []


def _lazy_raylane_imports(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, the comment just above or beside it) of each import of raylane inside a
    function."""
    lines = path.read_text().splitlines()
    found = set()
    for function in _functions(tree):
        for node in ast.walk(function):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["raylane"]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name.split(".")[0] == "raylane" for name in names):
                found.add(node.lineno)
    reasons = []
    for line in sorted(found):
        here, above = lines[line - 1], lines[line - 2].strip()
        reason = here.partition("#")[2] or (above[1:] if above.startswith("#") else "")
        reasons.append((line, reason.strip()))
    return reasons


def test_raylane_imports_sit_at_the_top_of_modules_save_a_few_with_their_reason():
    lazy = {
        f"{path.relative_to(ROOT)}:{line}": reason
        for path, tree in _modules(PACKAGE)
        for line, reason in _lazy_raylane_imports(path, tree)
    }
    assert len(lazy) <= 20, sorted(lazy)
    assert [where for where, reason in lazy.items() if not reason] == []
