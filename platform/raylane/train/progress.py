"""Progress on the driver's console while Ray Train runs the job: one line per finished epoch
and, inside a long epoch, one every `training.progress_every_s` seconds (printed by
`raylane.train.recorder` as rank 0's journal grows), with Ray's own worker logs left in Ray's
log files."""

from __future__ import annotations

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


def format_progress(record: dict) -> str:
    """One in-epoch line from rank 0's `progress` record: `  epoch 2, step 40/120  1,234
    samples/s  data wait 3 %  12 s left in the epoch` (the step total and what is left where
    the epoch's length is known)."""
    steps = record.get("steps")
    step = f"{record['step']}/{steps}" if steps else str(record["step"])
    parts = [f"  epoch {record['epoch'] + 1}, step {step}"]
    parts.append(f"{record['samples_per_s']:,.0f} samples/s")
    parts.append(f"data wait {100 * record['data_wait_share']:.0f} %")
    if steps and record["step_s"] > 0:
        parts.append(f"{record['step_s'] * (steps - record['step']):.0f} s left in the epoch")
    return "  ".join(parts)


class ProgressTicker:
    """Rank 0's progress inside an epoch: once every `every_s` seconds (0: never), a record of
    the steps done, the samples per second and the share of time spent waiting for data over
    the last interval, handed to `emit` (the run's journal, which the driver prints)."""

    def __init__(self, every_s: float, emit, global_batch: int, clock=None):
        import time

        self.every_s, self.emit, self.global_batch = every_s, emit, global_batch
        self.clock = clock or time.monotonic
        self._reset(0, None)

    def _reset(self, epoch: int, steps: int | None) -> None:
        self.epoch, self.steps = epoch, steps
        self.since = self.clock()
        self.steps_since, self.waited = 0, 0.0

    def start(self, epoch: int, steps: int | None) -> None:
        """An epoch of `steps` optimizer steps (None: not known ahead) begins."""
        self._reset(epoch, steps)

    def step_done(self, step: int, data_wait_s: float) -> None:
        """Step `step` (0-based) ended, after waiting `data_wait_s` for its batch."""
        if self.every_s <= 0:
            return
        self.steps_since += 1
        self.waited += data_wait_s
        now = self.clock()
        interval = now - self.since
        if interval < self.every_s:
            return
        step_s = interval / self.steps_since
        self.emit({
            "epoch": self.epoch, "step": step + 1, "steps": self.steps,
            "samples_per_s": self.steps_since * self.global_batch / interval,
            "data_wait_share": min(self.waited / interval, 1.0), "step_s": step_s,
        })  # fmt: skip
        self.since, self.steps_since, self.waited = now, 0, 0.0
