"""The driver's side of the run's journal (`raylane.train.journal`): while the fit runs, rank
0's records go into the MLflow run and each finished epoch gets one line on the console.

A thread reads the journal twice a second. Placement and code identity, epoch metrics, tables
and the step-time split figure (drawn by a Ray task) are logged through one `EpochLogger`,
whose outage buffer keeps training going while the tracking server is away; past the outage
window the recorder stops the fit as Ctrl-C does (Ray Train aborts the run, which stays
resumable from its checkpoints) and the job ends with the logger's one line. Where ranks
run on the driver's own node, the driver samples that node's system metrics (ranks on other
nodes sample theirs).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from raylane.tracking.runs import EpochLogger, TrackingOutageError
from raylane.tracking.step_plot import STEP_SPLIT_ARTIFACT, step_split_png
from raylane.tracking.system_metrics import node_label, node_monitor
from raylane.train.journal import read_records
from raylane.train.progress import format_epoch, format_progress

log = logging.getLogger("raylane")

#: How long the end of a run waits for the step split figure's task (a process start and
#: matplotlib's import on a busy node).
DRAW_TIMEOUT_S = 120.0
#: The figure drawn by a Ray task where this process is connected to Ray: matplotlib, about
#: 33 MB resident once imported, stays out of the driver, whose memory is then its imports,
#: MLflow's store and Ray's, whatever the corpus or the run's length.
_draw_remote = ray.remote(num_cpus=0, max_retries=0)(step_split_png)


class RunRecorder:
    """Context manager: while open, log the journal's records into the run; after it, `draw()`
    the step split figure and `close()` (an outage waited out up to its window)."""

    def __init__(
        self,
        journal: Path,
        tracking_uri: str,
        run_id: str,
        epochs: int,
        outage_window_s: float,
        system_metrics_interval_s: float,
        driver_node: str | None = None,
        resumed: bool = False,
        emit: Callable[[str], None] = log.info,
        interval_s: float = 0.5,
    ):
        self.journal = journal
        self._offset = 0
        self._logger = EpochLogger(tracking_uri, run_id, outage_window_s)
        self._uri, self._run_id = tracking_uri, run_id
        self._epochs = epochs
        self._monitor_s = system_metrics_interval_s
        self.driver_node = driver_node
        self._resumed = resumed  # the journal holds epochs an earlier driver may have logged
        self._monitor = None
        self._emit = emit
        self._interval_s = interval_s
        self._history: list[dict[str, float]] = []
        self._figure_due = False
        self._drawing: ray.ObjectRef | None = None  # the figure's task, while it runs
        self._first: tuple[int, float] | None = None  # (first epoch shown, its record time)
        self._started = time.monotonic()
        self._opened_at = time.time()  # the journal's clock: records before it are replayed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raylane-recorder", daemon=True)
        self.error: Exception | None = None  # the outage that stopped the fit
        self.placement: list[dict] | None = None  # the latest worker group's ranks
        self._interrupts = False  # whether an outage may stop the fit with SIGINT

    def __enter__(self) -> RunRecorder:
        self._started, self._opened_at = time.monotonic(), time.time()
        # Ray Train aborts a fit on SIGINT where the fit runs on the main thread; elsewhere
        # (a library caller's thread) the outage ends the job when the fit returns.
        self._interrupts = threading.current_thread() is threading.main_thread()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop reading, take in what the journal holds now (best effort: the fit may have
        failed) and stop sampling this node."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join()
        try:
            self.poll()
        except Exception as exc:  # noqa: BLE001 - an outage is waited out by `finish`
            log.debug("run record: %s", exc)
        if self._monitor is not None:
            try:
                self._monitor.finish()  # its last samples, sent to the tracking server
            except Exception as exc:  # noqa: BLE001 - never mask how the fit ended
                reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                log.warning("this node's last system metrics not logged: %s", reason)
            self._monitor = None

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll()
            except TrackingOutageError as outage:
                self.error = outage
                if self._interrupts:
                    signal.raise_signal(signal.SIGINT)  # Ray Train aborts the fit on Ctrl-C
                return

    def poll(self) -> None:
        """Log every record appended since the last poll, in order. A record that cannot be
        logged (an artifact during an outage) is said in one line and the rest go on; metrics
        wait in the logger's buffer, and an outage past its window is raised."""
        outage = None
        records, self._offset = read_records(self.journal, self._offset)
        for record in records:
            try:
                self._apply(record)
            except TrackingOutageError as past_window:  # its metrics are buffered
                outage = past_window
            except Exception as exc:  # noqa: BLE001
                log.warning("run record %s not logged: %s", record.get("kind"), exc)
        self._log_figure(wait_s=0)
        idle = self._drawing is None and not self._stop.is_set()
        if self._figure_due and idle and outage is None:
            self._draw_figure()
        if outage is not None:
            raise outage

    def draw(self) -> None:
        """After the fit: the step split figure of the last epochs, waited for."""
        if self._figure_due:
            self._log_figure(wait_s=DRAW_TIMEOUT_S)  # the one in flight, for fewer epochs
            self._draw_figure()
        self._log_figure(wait_s=DRAW_TIMEOUT_S)

    def close(self) -> None:
        """After the fit: what an outage held back, waiting for the server up to the window
        (past it, TrackingOutageError)."""
        self._logger.close()

    def _draw_figure(self) -> None:
        """Start drawing the figure of the epochs so far, in a Ray task (called when none is
        in flight: a task interrupted inside matplotlib's import leaves its worker unable to
        import it again); without Ray, draw and log it here."""
        self._figure_due = False
        if not self._history:
            return
        if not ray.is_initialized():
            self._log_drawn(lambda: step_split_png(self._history))
            return
        self._drawing = _draw_remote.remote(list(self._history))

    def _log_figure(self, wait_s: float) -> None:
        """Log the figure once its task is done, waiting up to `wait_s` (the poll does not
        wait; the end of the run does, and then cancels a task past it)."""
        if self._drawing is None:
            return
        done, _ = ray.wait([self._drawing], timeout=wait_s)
        if not done:
            if wait_s:
                ray.cancel(self._drawing, force=True)
                self._drawing = None
                log.warning("%s not drawn in %.0f s", STEP_SPLIT_ARTIFACT, wait_s)
            return
        drawing, self._drawing = self._drawing, None
        self._log_drawn(lambda: ray.get(drawing))

    def _log_drawn(self, draw: Callable[[], bytes]) -> None:
        try:
            png = draw()
        except Exception as exc:  # noqa: BLE001 - the metrics are logged; say it and go on
            log.warning("%s not drawn: %s", STEP_SPLIT_ARTIFACT, exc)
            return
        self._logger.log_step_split(png)

    def _apply(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "group":
            self.placement = record["placement"]
            self._monitor_driver_node(record["placement"])
            self._logger.log_placement(record["placement"])
            self._logger.log_code_identity(record["placement"], record["requirements"])
        elif kind == "metrics":
            self._logger.log(record["metrics"], step=record["step"], at=record["time"])
        elif kind == "tables":
            self._logger.log_tables(record["tables"])
        elif kind == "progress":
            # A resumed run's journal replays an earlier driver's lines: not shown again.
            if not self._resumed or record["time"] >= self._opened_at:
                self._emit(format_progress(record))
        elif kind == "epoch":
            epoch, metrics = record["epoch"], record["metrics"]
            if self._resumed and self._logger.holds(epoch):
                self._history.append(metrics)  # logged by the driver that was killed
                return
            if self._logger.log_epoch(metrics, epoch, record["again"], at=record["time"]):
                self._history.append(metrics)
                self._figure_due = True
                self._logger.log_tables(record["tables"])
                self._show(epoch, metrics, record["time"])

    def _show(self, epoch: int, metrics: dict[str, float], logged: float) -> None:
        if self._first is None:
            self._first = (epoch, logged)
        per_epoch = None
        if epoch > self._first[0]:
            per_epoch = (logged - self._first[1]) / (epoch - self._first[0])
        elapsed = time.monotonic() - self._started
        self._emit(format_epoch(epoch, self._epochs, metrics, elapsed, per_epoch))

    def _monitor_driver_node(self, placement: list[dict]) -> None:
        """Sample this node's system metrics into the run when ranks run on it (once)."""
        if self._monitor is not None or self._monitor_s <= 0:
            return
        if not any(rank["node_id"] == self.driver_node for rank in placement):
            return
        # MLflow's monitor announces its start and stop on INFO: not for the driver's console.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        self._monitor = node_monitor(self._uri, self._run_id, self._monitor_s, node_label())
        self._monitor.start()
