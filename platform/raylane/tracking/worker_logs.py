"""Each training worker's console output, kept with its run in MLflow.

Ray points every worker process's stdout and stderr at log files on the worker's node; the
user's console shows only raylane's progress lines. At the end of the loop (also when it
fails) each rank logs its own two files as `logs/rank-N.out` / `.err` artifacts of the run, so
the details are one click from the run, wherever the worker ran.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("raylane")

LOG_DIR = "logs"


def console_files() -> dict[str, Path]:
    """This process's stdout/stderr files, where they are files (Linux: /proc/self/fd)."""
    found = {}
    for suffix, fd in (("out", 1), ("err", 2)):
        try:
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # not Linux, or not redirected
        if target.is_file():
            found[suffix] = target
    return found


def log_worker_logs(tracking_uri: str, run_id: str, rank: int) -> list[str]:
    """Log this worker's console files into the run; returns the artifact paths written."""
    from mlflow.tracking import MlflowClient

    sys.stdout.flush()
    sys.stderr.flush()
    client = MlflowClient(tracking_uri=tracking_uri)
    written = []
    for suffix, path in console_files().items():
        text = path.read_text(errors="replace")
        if text.strip():
            artifact = f"{LOG_DIR}/rank-{rank}.{suffix}"
            client.log_text(run_id, text, artifact)
            written.append(artifact)
    return written
