"""Each training worker's console output, kept with its run in MLflow.

Ray points every worker process's stdout and stderr at log files on the worker's node; the
user's console shows only raylane's progress lines. When the fit ends (also when it fails) the
driver reads each rank's two files (from its own node's log directory, or through Ray's state
API from the rank's node; rank 0 journals each rank's node and process) and logs them as
`logs/rank-N.out` / `.err` artifacts of the run, so the details are one click from the run.
The workers send nothing: a rank that only uploaded its log would import MLflow for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("raylane")

LOG_DIR = "logs"


def keep_worker_logs(client, run_id: str, placement: list[dict]) -> list[str]:
    """Log every rank's console files into the run; returns the artifact paths written.

    `placement`: the last worker group's ranks (node id and process id each). Best effort:
    what cannot be read is said in one line."""
    written = []
    for rank in placement:
        for suffix in ("out", "err"):
            try:
                text = _console_text(rank, suffix)
            except Exception as exc:  # noqa: BLE001 - a node gone with its files: say so, go on
                log.warning("rank %d's %s log not kept: %s", rank["rank"], suffix, exc)
                continue
            if text.strip():
                artifact = f"{LOG_DIR}/rank-{rank['rank']}.{suffix}"
                client.log_text(run_id, text, artifact)
                written.append(artifact)
    return written


def _console_text(rank: dict, suffix: str) -> str:
    """A rank's stdout or stderr: read from this node's Ray log directory when the rank ran
    here, else through Ray's state API from the rank's node (the cluster this driver is
    connected to, not whichever Ray on this machine started last)."""
    import ray
    from ray.util.state import get_log

    context = ray.get_runtime_context()
    if rank["node_id"] == context.get_node_id():
        logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
        found = sorted(logs.glob(f"worker-*-{rank['pid']}.{suffix}"))
        if found:
            return found[-1].read_text(errors="replace")
    lines = get_log(
        address=context.gcs_address,
        node_id=rank["node_id"],
        pid=rank["pid"],
        suffix=suffix,
        errors="replace",
    )
    return "".join(lines)
