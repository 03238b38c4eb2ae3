"""What a measured trial says about the profile's predictions: the throughput metric trials
report, and the calibration one measured layout gives the rest (used by the search and by the
predicted-first searcher alike)."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.plan.measured import LocalPrediction

METRIC = "train_samples_per_s"


@dataclass(frozen=True)
class Calibration:
    """What the first measured trial showed the profile-only predictions miss."""

    layout: str
    step_scale: float  # measured / predicted step time, input wait left out
    data_wait_s: float  # measured wait for input per step
    memory_offset_mb: float  # measured - predicted peak worker memory

    def apply(self, predicted: LocalPrediction) -> LocalPrediction:
        return predicted.calibrated(self.step_scale, self.data_wait_s, self.memory_offset_mb)


def measured_calibration(
    layout: str,
    predicted: LocalPrediction,
    step_ms: float,
    data_wait_ms: float | None,
    peak_mb: float | None,
) -> Calibration:
    """What one measured layout says about the profile's predictions."""
    wait_ms = min(data_wait_ms or 0.0, step_ms)
    return Calibration(
        layout=layout,
        step_scale=(step_ms - wait_ms) / predicted.step_ms,
        data_wait_s=wait_ms / 1000,
        memory_offset_mb=(peak_mb or predicted.memory_mb) - predicted.memory_mb,
    )
