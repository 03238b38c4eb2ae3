"""The run's journal: what rank 0 has for the run's MLflow record, handed to the driver.

Rank 0 appends one JSON line per event (its worker group's placement, an epoch's metrics and
tables, a restart's size and lost steps) to `raylane_journal.jsonl` in the run's directory,
beside the checkpoints the driver reads as well. The driver reads the journal as it grows and
logs each event into the MLflow run (`raylane.train.recorder`), so no worker imports MLflow
or opens the store (a second of CPU and more on the critical path of every run), and a tracking
outage is waited out by the driver while the workers train on. The journal stays with the run:
a driver that was killed and resumes the run logs what its predecessor had not.

Rank 0 writes each record (flushed to disk) before the report that ends its epoch, so the
driver has read everything once `fit()` returns.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

JOURNAL_FILE = "raylane_journal.jsonl"

log = logging.getLogger("raylane")


class Journal:
    """Rank 0's side: the calls an MLflow logger would take, appended as records."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps({**record, "time": time.time()}) + "\n"
        with self.path.open("a") as out:
            out.write(line)
            out.flush()
            os.fsync(out.fileno())

    def log_group(self, placement: list[dict], requirements: str) -> None:
        """A worker group started: where each rank runs, and the workers' packages."""
        self._append({"kind": "group", "placement": placement, "requirements": requirements})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._append({"kind": "metrics", "metrics": metrics, "step": step})

    def log_progress(self, progress: dict[str, Any]) -> None:
        """Where an epoch stands (`raylane.train.progress.ProgressTicker`)."""
        self._append({"kind": "progress", **progress})

    def log_tables(self, tables: dict[str, dict]) -> None:
        self._append({"kind": "tables", "tables": tables})

    def log_epoch(self, metrics: dict[str, float], epoch: int, again: bool, tables) -> None:
        """An epoch's metrics and the strategy's tables. `again`: the group restarted inside
        this epoch, which an earlier group may already have ended (the first record wins)."""
        record = {"kind": "epoch", "metrics": metrics, "epoch": epoch, "again": again}
        self._append({**record, "tables": tables})


def read_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete records after byte `offset` and the offset after them (a line still being
    written is left for the next read)."""
    try:
        with path.open("rb") as journal:
            journal.seek(offset)
            data = journal.read()
    except FileNotFoundError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]
    records = []
    for line in complete.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a rank 0 killed mid-line: the next group's records follow it
            log.warning("%s: a damaged record skipped (%d bytes)", path, len(line))
    return records, offset + len(complete)
