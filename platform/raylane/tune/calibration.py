"""What measured trials say about the profile's predictions: the throughput metric trials
report, and the calibration the measured layouts give the rest (used by the search and by the
predicted-first searcher alike)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from raylane.plan.measured import LocalPrediction

METRIC = "train_samples_per_s"


@dataclass(frozen=True)
class Calibration:
    """What measured trials showed the profile-only predictions miss."""

    layouts: tuple[str, ...]  # the measured layouts it comes from
    step_scale: float  # measured / predicted step time, input wait left out
    data_wait_s: float  # measured wait for input per step
    memory_offset_mb: float | None  # measured - predicted peak worker memory (None: unmeasured)

    def apply(self, predicted: LocalPrediction) -> LocalPrediction:
        offset = self.memory_offset_mb or 0.0
        return predicted.calibrated(self.step_scale, self.data_wait_s, offset)

    def source(self) -> str:
        """Where it comes from, for the console."""
        if len(self.layouts) == 1:
            return f"{self.layouts[0]}'s measurement"
        return f"the median of {len(self.layouts)} measured trials"


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
        layouts=(layout,),
        step_scale=(step_ms - wait_ms) / predicted.step_ms,
        data_wait_s=wait_ms / 1000,
        memory_offset_mb=None if peak_mb is None else peak_mb - predicted.memory_mb,
    )


def pooled(calibrations: Sequence[Calibration]) -> Calibration:
    """The median of several measured layouts' calibrations. One trial's step time moves 10-20 %
    between two measurements on a shared machine (benchmarks/README.md, prediction_error), and
    calibrating by that one moves every prediction with it; the median of each measured
    layout's measured/predicted ratio moves less with each trial measured."""
    if not calibrations:
        raise ValueError("pooled: no measured trial to calibrate by")
    offsets = [c.memory_offset_mb for c in calibrations if c.memory_offset_mb is not None]
    return Calibration(
        layouts=tuple(layout for c in calibrations for layout in c.layouts),
        step_scale=statistics.median(c.step_scale for c in calibrations),
        data_wait_s=statistics.median(c.data_wait_s for c in calibrations),
        memory_offset_mb=statistics.median(offsets) if offsets else None,
    )
