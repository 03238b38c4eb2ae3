"""Run the README's and the docs' blocks as a person would: a fresh copy of the repository, a
clean environment.

The copy holds the repository's files (no data, runs, MLflow store or generated configs) and
links the installed `.venv`; HOME is a fresh folder, so Ray's token file and caches are the
copy's own, and no RAY_* / MLFLOW_* / RAYLANE_* variable of the test session leaks in.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.reaper import MARK as LEFT
from tests.readme_blocks import ROOT, Block

MARK = ">>> "
REAPER = Path(__file__).with_name("reaper.py")


@dataclass
class Command:
    text: str
    output: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.strip()]


@dataclass
class BlockRun:
    returncode: int
    commands: list[Command]
    #: The command lines of the processes the block started that were still running when it
    #: returned (`tests/integration/reaper.py`).
    left: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "\n".join(f"{MARK}{c.text}\n{c.output}" for c in self.commands)

    def command(self, start: str) -> Command:
        return next(c for c in self.commands if c.text.startswith(start))


def fresh_copy(target: Path) -> Path:
    """The repository's tracked and unignored files and its `.git`, copied; `.venv` linked."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    # A clone has its history: commands that record the commit (`raylane runtime-env`) see it.
    shutil.copytree(ROOT / ".git", target / ".git", symlinks=True)
    (target / ".venv").symlink_to(ROOT / ".venv")
    return target


def clean_env(copy: Path, home: Path) -> dict[str, str]:
    """A shell as after `source .venv/bin/activate` in the copy, with nothing of this session."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "MLFLOW_", "RAYLANE_", "PYTEST_", "VIRTUAL_ENV"))
    }
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        VIRTUAL_ENV=str(copy / ".venv"),
        PATH=f"{copy / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def script(block: Block, substitutions: dict[str, str] | None = None) -> str:
    """The block as one bash script that marks where each command starts."""
    lines = ["set -eo pipefail"]  # like a terminal, but stop at the first failure
    for command in block.commands():
        for placeholder, value in (substitutions or {}).items():
            command = command.replace(placeholder, value)
        # On a line of its own even when the previous output did not end with one (curl).
        marker = MARK + " ".join(command.split())  # one line, even for a multi-line command
        lines.append(f"printf '\\n%s\\n' {shlex.quote(marker)}")
        lines.append(command)
    return "\n".join(lines) + "\n"


def _split(output: str) -> list[Command]:
    commands: list[Command] = []
    for line in output.splitlines():
        if line.startswith(MARK):
            commands.append(Command(line[len(MARK) :], ""))
        elif commands:
            commands[-1].output += line + "\n"
    return commands


def run_block(
    block: Block,
    copy: Path,
    env: dict[str, str],
    timeout_s: float,
    substitutions: dict[str, str] | None = None,
) -> BlockRun:
    """The whole block in one shell (its `export`s and `source` carry from line to line), under
    `reaper.py`: `BlockRun.left` is what it left running."""
    process = subprocess.Popen(
        [sys.executable, str(REAPER), "bash", "-c", script(block, substitutions)],
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # past its time the whole block is stopped, not the reaper
    )
    try:
        stdout, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    output, marked, report = stdout.rpartition(f"\n{LEFT}")
    assert marked, f"reaper.py gave no report (exit {process.returncode}):\n{stdout[-3000:]}"
    left = json.loads(report.splitlines()[0])
    return BlockRun(process.returncode, _split(output), left)


def run_commands(
    block: Block,
    copy: Path,
    env: dict[str, str],
    timeout_s: float,
    fill: Callable[[str, list[Command]], str],
) -> BlockRun:
    """One shell per command, for blocks whose placeholders come from an earlier command's
    output: `fill(command, done_so_far)` substitutes them."""
    done: list[Command] = []
    deadline = time.monotonic() + timeout_s
    for command in block.commands():
        text = fill(command, done)
        finished = subprocess.run(
            ["bash", "-c", f"set -eo pipefail\n{text}"],
            cwd=copy,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        done.append(Command(text, finished.stdout))
        if finished.returncode:
            return BlockRun(finished.returncode, done)
    return BlockRun(0, done)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Background:
    """A block whose command keeps running (a server): started, waited for, stopped by Ctrl-C."""

    def __init__(self, block: Block, copy: Path, env: dict[str, str], log: Path):
        self.log = log
        self._handle = log.open("w")
        self.process = subprocess.Popen(
            ["bash", "-c", script(block)],
            cwd=copy,
            env=env,
            stdout=self._handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: Ctrl-C reaches all of it
            # As in a terminal: Ctrl-C interrupts even when the suite itself was started in
            # the background (a shell then ignores SIGINT, and children inherit that).
            preexec_fn=_default_sigint,
        )

    def wait_until_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"exited {self.process.returncode}:\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"{url} not ready after {timeout_s:.0f} s:\n{self.output()[-3000:]}")

    def interrupt(self, timeout_s: float = 120) -> int:
        """Ctrl-C, as the docs say; the whole group is killed if it does not stop in time."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._handle.close()
        return self.process.returncode

    def output(self) -> str:
        if not self._handle.closed:
            self._handle.flush()
        return self.log.read_text()
