"""Straight lines fitted to what the profile measured: compute as fixed + per-row seconds, links
as alpha + beta * bytes (`raylane.profile.worker`; read back by `raylane.plan.measured`)."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.models.shape import DecoderShape


@dataclass(frozen=True)
class LinkFit:
    """Seconds to move `nbytes` = alpha + beta * nbytes (ring steps included for collectives)."""

    alpha_s: float
    beta_s_per_byte: float

    @property
    def gbps(self) -> float:
        return 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else float("inf")


@dataclass(frozen=True)
class ComputeFit:
    """Seconds for `rows` = fixed_s + per_row_s * rows (the fixed part: per-op overhead)."""

    fixed_s: float
    per_row_s: float


def block_train_flops(rows: int, shape: DecoderShape) -> float:
    """Forward and backward FLOPs of one of `shape`'s blocks on `rows` whole sequences (for a
    GPT, Megatron's 3 x 24·b·s·h²·(1 + s/6h))."""
    blocks, _ = shape.forward_flops_per_token()
    return 3 * rows * shape.context_length * blocks / shape.n_layers


def fit_line(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope, both clamped at zero."""
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return max(float(intercept), 0.0), max(float(slope), 0.0)


def compute_fit(by_rows: dict[int, float]) -> ComputeFit:
    rows = sorted(by_rows)
    return ComputeFit(*fit_line(rows, [by_rows[r] for r in rows]))


def link_fit(by_size: dict[int, float]) -> LinkFit:
    sizes = sorted(by_size)
    return LinkFit(*fit_line(sizes, [by_size[s] for s in sizes]))
