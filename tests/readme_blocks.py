"""The command blocks of README.md and of the documentation site (docs/**/*.md), read the way a
person copies them.

Every fenced block in those files is preceded by a marker comment:

    <!-- readme-test: run -->                 executed from a fresh copy of the repository
    <!-- readme-test: skip: <why> -->         cannot run here (a Docker engine, kubectl, GPU, the
                                              suite itself); checked structurally instead
    <!-- readme-test: text -->                 not commands (a diagram, a config excerpt)

Placeholders such as `<run>` are written in angle brackets and documented next to the block;
the tests substitute them and nothing else.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def sources() -> list[Path]:
    """README.md, then every page of the documentation site, in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


_MARKER = re.compile(r"^<!-- readme-test: (run|skip|text)(?::\s*(.*?))?\s*-->$")
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path  # the file the block is in
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mode: str  # run | skip | text | "" (no marker)
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def commands(self) -> list[str]:
        """Shell commands: continuation lines joined, comments and blank lines dropped."""
        joined, current = [], ""
        for raw in self.text.splitlines():
            line = raw.rstrip()
            if line.endswith("\\"):
                current += line[:-1] + " "
                continue
            current += line
            if _quote_open(current):  # a quoted argument (say a JSON body) spans lines
                current += "\n"
                continue
            stripped = _strip_comment(current).strip()
            if stripped:
                joined.append(stripped)
            current = ""
        return joined


def _quote_open(text: str) -> bool:
    try:
        shlex.split(_strip_comment(text))
    except ValueError:
        return True
    return False


def _strip_comment(line: str) -> str:
    """Drop a trailing `# ...` that is outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def read_blocks(paths: list[Path] | None = None) -> list[Block]:
    """The fenced blocks of `paths` (default: README.md and docs/**/*.md), file by file."""
    return [block for path in paths or sources() for block in _file_blocks(path)]


def _file_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = _MARKER.match(lines[i - 1].strip()) if i else None
        blocks.append(
            Block(
                path=path,
                line=i + 1,
                lang=fence.group(1),
                text="\n".join(lines[i + 1 : end]),
                mode=marker.group(1) if marker else "",
                reason=(marker.group(2) or "") if marker else "",
            )
        )
        i = end + 1
    return blocks


def split_command(command: str) -> list[str]:
    """argv of one command line, with `$VAR` / `$(...)` left as written."""
    return shlex.split(command, posix=True)


def usage_lines(path: Path) -> list[str]:
    """Command lines (`raylane ...`, `ray job submit ...`, `serve run ...`) in a file's leading
    comment or docstring."""
    found = []
    text = path.read_text()
    head = text.split("\n\n\n", 1)[0] if path.suffix == ".py" else text
    joined = re.sub(r"\\\n\s*", " ", head)
    for line in joined.splitlines():
        command = _USAGE.match(line)
        if command:
            found.append(_strip_comment(line[command.start(1) :]).strip())
    return found


# A command at the start of a comment or docstring line, optionally after a label ("Run it:").
_USAGE = re.compile(
    r"(?<=^)\s*#?\s*(?:[A-Z][\w ]*:\s+)?(?:RAY_AUTH_MODE=\S+\s+)?"
    r"(raylane [a-z]+ |ray job submit |python pipelines/|serve (?:run|deploy) )"
)
