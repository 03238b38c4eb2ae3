"""Each training worker's console output, kept with its run in MLflow.

Ray points every worker process's stdout and stderr at log files on the worker's node; the
user's console shows only raylane's progress lines. When the fit ends (also when it fails) the
driver reads each rank's two files through Ray's state API (wherever the rank ran; its node and
process are in the run's placement record) and logs them as `logs/rank-N.out` / `.err`
artifacts of the run, so the details are one click from the run. The workers themselves send
nothing: a rank that only uploaded its log would import MLflow and open the store for it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("raylane")

LOG_DIR = "logs"


def keep_worker_logs(client, run_id: str) -> list[str]:
    """Log every rank's console files into the run; returns the artifact paths written.

    The ranks are the last worker group's, as rank 0 recorded them; a run that failed before
    rank 0 recorded them keeps none. Best effort: what cannot be read is said in one line."""
    import tempfile

    from ray.util.state import get_log

    from raylane.tracking.runs import PLACEMENT_ARTIFACT

    try:
        with tempfile.TemporaryDirectory() as directory:
            path = client.download_artifacts(run_id, PLACEMENT_ARTIFACT, directory)
            ranks = json.loads(Path(path).read_text())["ranks"]
    except Exception as exc:  # noqa: BLE001 - no placement record: the group never started
        log.debug("worker logs: no placement record (%s)", exc)
        return []
    written = []
    for rank in ranks:
        for suffix in ("out", "err"):
            try:
                text = "".join(get_log(node_id=rank["node_id"], pid=rank["pid"], suffix=suffix))
            except Exception as exc:  # noqa: BLE001 - a node gone with its files: say so, go on
                log.warning("rank %d's %s log not kept: %s", rank["rank"], suffix, exc)
                continue
            if text.strip():
                artifact = f"{LOG_DIR}/rank-{rank['rank']}.{suffix}"
                client.log_text(run_id, text, artifact)
                written.append(artifact)
    return written
