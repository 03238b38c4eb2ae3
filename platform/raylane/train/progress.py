"""Per-epoch progress on the driver's console while Ray Train runs the job: one line per
finished epoch (printed by `raylane.train.recorder` as rank 0's journal grows), with Ray's
own worker logs left in Ray's log files."""

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
