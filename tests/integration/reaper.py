"""Run a command as a child subreaper (Linux): every process the command starts that is still
alive when the command returns is re-parented here, whatever it double-forked through, and is
reported on the last line of the output as `LEFT <json>` (left running: a block may start a
cluster that a later block uses).

    python reaper.py bash -c '...'
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import psutil

PR_SET_CHILD_SUBREAPER = 36
MARK = "LEFT "


def _reap() -> None:
    """Collect the exit status of every child that has ended (a zombie is not left running)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    code = subprocess.call(argv)
    sys.stdout.flush()
    _reap()
    left = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline())[:160] or process.name())
        except psutil.NoSuchProcess:
            continue
    print(f"\n{MARK}{json.dumps(left)}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
