"""Choose what a search measures: profile the model on this cluster (once; reused from MLflow
while model and cluster are unchanged), predict every valid layout's step time and peak
worker memory, prune what is predicted over the memory budget, and keep the `top_k` predicted
fastest, best first."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ray.tune.search import Searcher

from raylane.config import ConfigError, RaylaneConfig
from raylane.models.families import shape_of
from raylane.plan.measured import LocalPrediction, ProfileMismatch, predict_config
from raylane.profile.job import load_or_measure
from raylane.tracking import resolve_tracking_uri
from raylane.tune.calibration import METRIC, Calibration, measured_calibration, pooled
from raylane.tune.candidates import Candidate, Pruned, trial_config
from raylane.tune.spec import TuneSpec

log = logging.getLogger("raylane")


@dataclass
class Ranking:
    launch: list[Candidate]  # the top k, best predicted first
    not_run: list[Candidate]  # fit the budget, predicted slower than the top k
    pruned: list[Pruned]  # predicted over the memory budget
    predictions: dict[str, LocalPrediction]
    profile_run_id: str
    profile_s: float


def profile_input(spec: TuneSpec, candidates: list[Candidate]) -> tuple[RaylaneConfig, list[int]]:
    """What the search profiles: its widest candidate's config, at each of its worker counts."""
    widest = max(candidates, key=lambda c: c.overrides["parallelism.workers"])
    base = trial_config(spec, widest)
    try:
        shape_of(base.model)
    except ValueError as error:
        raise ConfigError(
            f"predict.enabled: {error}; set predict.enabled=false to measure every layout"
        ) from None
    return base, sorted({c.overrides["parallelism.workers"] for c in candidates})


def rank_candidates(spec: TuneSpec, candidates: list[Candidate]) -> Ranking:
    """Profile (or reuse the profile), then rank; expects Ray to be connected."""
    base, levels = profile_input(spec, candidates)
    started = time.perf_counter()
    log.info("profiling the model at %s workers at a time (reused when already measured)", levels)
    profile, run_id, reused = load_or_measure(
        base, resolve_tracking_uri(spec.tracking_uri), concurrency=levels
    )
    profile_s = time.perf_counter() - started
    log.info(
        "profile %s (MLflow run %s, %.0f s)", "reused" if reused else "measured", run_id, profile_s
    )
    return rank_with_profile(spec, candidates, profile, run_id, profile_s)


def rank_with_profile(
    spec: TuneSpec,
    candidates: list[Candidate],
    profile: dict,
    run_id: str = "",
    profile_s: float = 0.0,
) -> Ranking:
    """Predict every candidate from `profile`, prune by memory, keep the top k."""
    configs = {c.key: trial_config(spec, c) for c in candidates}
    predictions: dict[str, LocalPrediction] = {}
    fitting: list[Candidate] = []
    pruned: list[Pruned] = []
    for candidate in candidates:
        try:
            predicted = predict_config(profile, configs[candidate.key])
        except ProfileMismatch as exc:
            raise ConfigError(f"{candidate.key}: {exc}") from None
        predictions[candidate.key] = predicted
        reason = over_budget(spec, predicted)
        if reason:
            pruned.append(Pruned(candidate, reason))
        else:
            fitting.append(candidate)
    fitting.sort(key=lambda c: -predictions[c.key].samples_per_s)
    k = spec.predict.top_k
    return Ranking(
        launch=fitting[:k],
        not_run=fitting[k:],
        pruned=pruned,
        predictions=predictions,
        profile_run_id=run_id,
        profile_s=profile_s,
    )


def over_budget(spec: TuneSpec, predicted: LocalPrediction) -> str | None:
    """Why a prediction breaks the spec's memory budgets (peak, then activations), or None."""
    budget, activations = spec.constraints.memory_mb_per_worker, predicted.activation_mb
    if predicted.memory_mb > budget:
        return f"predicted peak {predicted.memory_mb:,.0f} MB over the {budget:,.0f} MB budget"
    limit = spec.constraints.activation_mb_per_worker
    if limit is not None and activations > limit:
        return f"predicted activations {activations:,.1f} MB over the {limit:,.1f} MB budget"
    return None


class PredictedFirst(Searcher):
    """A Ray Tune search algorithm over the ranked layouts: it suggests them best-predicted
    first, one at a time, and stops suggesting as soon as the next one, with its prediction
    calibrated by the trials measured so far, is predicted more than `margin` slower than the
    best throughput measured. Layouts it never suggested are in `skipped`, with the reason."""

    def __init__(
        self,
        order: list[str],
        predictions: dict[str, LocalPrediction],
        margin: float,
        warmup_epochs: int,
        metric: str,
    ):
        super().__init__(metric=metric, mode="max")
        self.pending = list(order)
        self.predictions = predictions
        self.margin = margin
        self.warmup_epochs = warmup_epochs
        self.running: dict[str, str] = {}  # trial id -> layout
        self.epochs: dict[str, list[dict]] = {}  # layout -> its reported epochs
        self.best: tuple[str, float] | None = None  # layout, measured samples/s
        self.calibrate = None  # LocalPrediction -> LocalPrediction, from those measured
        self.calibrations: list[Calibration] = []  # one per measured layout
        self.skipped: dict[str, str] = {}  # layout -> why it was not measured

    def suggest(self, trial_id: str):
        if not self.pending:
            return Searcher.FINISHED
        key = self.pending[0]
        if self.best is not None and self.calibrate is not None:
            expected = self.calibrate(self.predictions[key]).samples_per_s
            best_key, best = self.best
            if expected < (1 - self.margin) * best:
                # Ranked best first: every later layout is predicted slower still.
                for rest in self.pending:
                    predicted = self.calibrate(self.predictions[rest]).samples_per_s
                    self.skipped[rest] = (
                        f"predicted {1 - predicted / best:.0%} slower than {best_key} measured"
                    )
                self.pending = []
                return Searcher.FINISHED
        self.pending.pop(0)
        self.running[trial_id] = key
        return {"key": key}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        key = self.running.get(trial_id)
        if key is not None:
            self.epochs.setdefault(key, []).append(result)

    def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
        import statistics

        key = self.running.pop(trial_id, None)
        epochs = self.epochs.get(key or "", [])
        measured = epochs[self.warmup_epochs :] or epochs
        if error or not measured or any(METRIC not in e for e in measured):
            return
        samples_per_s = statistics.median(e[METRIC] for e in measured)
        if self.best is None or samples_per_s > self.best[1]:
            self.best = (key, samples_per_s)
        if "step_ms" in measured[0]:
            step_ms = statistics.median(e["step_ms"] for e in measured)
            wait_ms = statistics.median(e.get("step_data_wait_ms", 0.0) for e in measured)
            calibration = measured_calibration(key, self.predictions[key], step_ms, wait_ms, None)
            self.calibrations.append(calibration)
            self.calibrate = pooled(self.calibrations).apply
