"""The documentation: README.md is a front page, docs/ a site that builds with `mkdocs build
--strict` (every link between pages and to a heading resolves), every fenced block in either says
whether the suite runs it, and the strategy table says what the presets say."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from raylane.config.presets import PRESETS, Preset
from tests.readme_blocks import README, ROOT, read_blocks, sources

README_MOST_LINES = 300
_ANY_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_TABLE = re.compile(r"<!-- strategy-table:begin -->\n(.*?)\n<!-- strategy-table:end -->", re.S)


def test_the_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    home = (site / "index.html").read_text()
    assert "Open Inference Protocol" in home and 'href="guides/layouts/"' in home
    # A guide keeps its runnable block, and the figures page is benchmarks/README.md itself.
    serving = (site / "guides" / "serving" / "index.html").read_text()
    assert "v2/models/digits/infer" in serving
    figures = (site / "benchmarks" / "figures" / "index.html").read_text()
    assert 'id="job_startuppy"' in figures and "--8&lt;--" not in figures
    assert (site / "reference" / "raylane-config.schema.json").is_file()


def test_readme_is_a_front_page_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MOST_LINES, len(text.splitlines())
    targets = [t for t in _LINK.findall(text) if not t.startswith(("http://", "https://"))]
    assert any(t.startswith("docs/") for t in targets), targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_fenced_block_has_a_marker(path):
    """Counted on every fence line, indented or not, so that no block escapes the reader."""
    fences = [line for line in path.read_text().splitlines() if _ANY_FENCE.match(line)]
    blocks = read_blocks([path])
    assert len(fences) == 2 * len(blocks), f"{path.name}: a fence the block reader does not see"
    unmarked = [b.where for b in blocks if not b.mode]
    assert not unmarked, f"blocks without a readme-test marker: {unmarked}"


def _cells(name: str, preset: Preset) -> list[str]:
    """A strategy's row of the table, from its preset."""

    def span(least_most: tuple[int, int | None]) -> str:
        least, most = least_most
        if least > 1:
            return f"required (≥ {least})"
        return "yes" if most is None else "no"

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    one = preset.dp == (1, 1)
    if preset.shard:
        workers = "shards"
    elif one:
        workers = "one"
    else:
        workers = f"replicas (≥ {preset.dp[0]})" if preset.dp[0] > 1 else "replicas"
    agree = {"all_reduce": "every step"}.get(preset.sync, preset.sync.replace("_", " "))
    agree += ", bounded staleness" if preset.bounded else ""
    return [
        f"`{name}`", workers, "—" if one else agree, span(preset.pp), span(preset.tp),
        yes(preset.cp), yes(preset.compression), yes(preset.elastic),
    ]  # fmt: skip


@pytest.mark.parametrize("page", ["README.md", "docs/guides/layouts.md"])
def test_the_strategy_table_is_the_presets(page):
    table = _TABLE.search((ROOT / page).read_text())
    assert table, f"{page} has no strategy table"
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.group(1).splitlines()[2:]
    ]
    assert rows == [_cells(name, preset) for name, preset in PRESETS.items()]
