"""A stacked bar per epoch: where the mean training step's time went."""

from __future__ import annotations

import io

from raylane.tracking.step_times import PARTS

STEP_SPLIT_ARTIFACT = "step_time_split.png"


def step_split_png(history: list[dict[str, float]]) -> bytes:
    """`step_split_figure` as PNG bytes (what the run logs as `STEP_SPLIT_ARTIFACT`)."""
    buffer = io.BytesIO()
    step_split_figure(history).savefig(buffer, format="png")
    return buffer.getvalue()


def step_split_figure(history: list[dict[str, float]]):
    """`history`: each epoch's metrics (`epoch`, `step_<part>_ms`, `step_ms`)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    epochs = [int(m["epoch"]) for m in history]
    bottom = [0.0] * len(history)
    for part in PARTS:
        values = [m.get(f"step_{part}_ms", 0.0) for m in history]
        if not any(values):
            continue
        axis.bar(epochs, values, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.plot(epochs, [m["step_ms"] for m in history], "k_", markersize=30, label="step (measured)")
    axis.set(xlabel="epoch", ylabel="ms per step (mean over workers)", title="step-time split")
    axis.set_xticks(epochs)
    axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    plt.close(figure)
    return figure
