"""Per-epoch progress on the driver's console while Ray Train runs the job.

The driver hears nothing from `trainer.fit()` until the job ends; rank 0 logs every epoch's
metrics into the run's MLflow record as it goes. A watcher thread reads that record once a
second and prints one line per finished epoch: what the person at the terminal wants, with
Ray's own worker logs left in Ray's log files.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("raylane")

SHOWN = ("train_loss", "val_loss", "val_bits_per_byte", "val_accuracy")


def format_epoch(
    epoch: int,
    epochs: int,
    metrics: dict[str, float],
    elapsed_s: float,
    seconds_per_epoch: float | None = None,
) -> str:
    """`epoch 3/10  train_loss 0.4123  ...  1,234 samples/s  12 s elapsed  ETA 28 s`.

    The ETA needs `seconds_per_epoch`, measured from the second epoch on: the first one also
    pays for starting the worker group.
    """
    done = epoch + 1
    parts = [f"epoch {done}/{epochs}"]
    parts += [f"{key} {metrics[key]:.4f}" for key in SHOWN if key in metrics]
    if "train_samples_per_s" in metrics:
        parts.append(f"{metrics['train_samples_per_s']:,.0f} samples/s")
    if "worker_device_peak_mb" in metrics:  # a GPU run: what the largest worker's GPU held
        parts.append(f"GPU peak {metrics['worker_device_peak_mb']:,.0f} MB")
    parts.append(f"{elapsed_s:.0f} s elapsed")
    if done < epochs and seconds_per_epoch is not None:
        parts.append(f"ETA {seconds_per_epoch * (epochs - done):.0f} s")
    return "  ".join(parts)


class EpochProgress:
    """Context manager: while open, emit one line per epoch that rank 0 logged to MLflow."""

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        epochs: int,
        emit: Callable[[str], None] = log.info,
        interval_s: float = 1.0,
    ):
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        self._run_id = run_id
        self._epochs = epochs
        self._emit = emit
        self._interval_s = interval_s
        self._shown: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="epoch-progress", daemon=True)
        self._started = 0.0
        self._first: tuple[int, int] | None = None  # (first epoch seen, its log time in ms)

    def __enter__(self) -> EpochProgress:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.poll()  # epochs that finished since the last look
        except Exception as exc:  # noqa: BLE001 - a tracking outage must not fail the run here
            log.debug("progress: %s", exc)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - progress must never stop training
                log.debug("progress: %s", exc)

    def poll(self) -> None:
        """Emit a line for each epoch logged since the last poll, in order."""
        history: dict[str, dict[int, float]] = {}
        logged_ms: dict[int, int] = {}  # when rank 0 logged each epoch
        for key in (*SHOWN, "train_samples_per_s"):
            for metric in self._client.get_metric_history(self._run_id, key):
                history.setdefault(key, {})[metric.step] = metric.value
                if key == "val_loss":
                    logged_ms[metric.step] = metric.timestamp
        now = time.monotonic()
        for step in sorted(set(logged_ms) - self._shown):
            metrics = {key: values[step] for key, values in history.items() if step in values}
            if self._first is None:
                self._first = (step, logged_ms[step])
            per_epoch = None
            if step > self._first[0]:
                per_epoch = (logged_ms[step] - self._first[1]) / 1000 / (step - self._first[0])
            self._shown.add(step)
            self._emit(format_epoch(step, self._epochs, metrics, now - self._started, per_epoch))
