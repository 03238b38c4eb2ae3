"""Run the parallelism search: enumerate, measure each candidate with Ray Tune, rank."""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from raylane.config import ConfigError
from raylane.data import ensure_dataset
from raylane.plan.measured import LocalPrediction
from raylane.runtime import verbose
from raylane.tune.calibration import METRIC, Calibration, measured_calibration, pooled
from raylane.tune.candidates import (
    TRIAL_DRIVER_CPU,
    Candidate,
    Pruned,
    enumerate_candidates,
    trial_config,
)
from raylane.tune.predicted import PredictedFirst, rank_candidates
from raylane.tune.progress import TrialProgress
from raylane.tune.spec import TuneSpec
from raylane.tune.trial import trial_driver

log = logging.getLogger("raylane")


@dataclass
class TrialOutcome:
    candidate: Candidate
    status: str  # "ok", "stopped early", "failed", "rejected", "not run"
    samples_per_s: float | None = None
    step_ms: float | None = None  # median over the measured epochs
    data_wait_ms: float | None = None  # the part of it spent waiting for input, likewise
    peak_rss_mb: float | None = None
    #: The largest worker's peak GPU memory (`worker_device_peak_mb`); None on CPU trials.
    peak_device_mb: float | None = None
    epochs: int = 0
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    predicted: LocalPrediction | None = None

    @property
    def step_error(self) -> float | None:
        """(predicted - measured) / measured step time, when both exist."""
        if self.predicted is None or not self.step_ms:
            return None
        return (self.predicted.step_ms - self.step_ms) / self.step_ms

    @property
    def peak_memory_mb(self) -> float | None:
        """The memory a worker's budget holds it to: its GPU's peak on a GPU trial (host RSS
        there is the CUDA context and libraries, not the model), else its peak RSS."""
        return self.peak_device_mb if self.peak_device_mb is not None else self.peak_rss_mb

    @property
    def world_size(self) -> int:
        return int(self.candidate.overrides["parallelism.workers"])


@dataclass
class SearchOutcome:
    trials: list[TrialOutcome]  # measured (launched) layouts
    pruned: list[Pruned]
    wall_s: float  # profile included
    not_run: list[TrialOutcome] = field(default_factory=list)  # predicted below the top k
    profile_run_id: str | None = None
    profile_s: float = 0.0
    calibration: Calibration | None = None
    #: The profile's own predictions, by layout, before any calibration.
    raw_predictions: dict[str, LocalPrediction] = field(default_factory=dict)

    @property
    def ranked(self) -> list[TrialOutcome]:
        measured = [t for t in self.trials if t.samples_per_s is not None]
        order = {"ok": 0, "stopped early": 1, "rejected": 2, "failed": 3}
        return sorted(measured, key=lambda t: (order[t.status], -t.samples_per_s)) + [
            t for t in self.trials if t.samples_per_s is None
        ]

    @property
    def winner(self) -> TrialOutcome | None:
        return next((t for t in self.ranked if t.status == "ok"), None)


def _scheduler(spec: TuneSpec):
    if spec.scheduler.kind == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(
        time_attr="training_iteration",
        max_t=spec.trial.epochs,
        grace_period=min(spec.scheduler.grace_period, spec.trial.epochs),
        reduction_factor=spec.scheduler.reduction_factor,
    )


def _judge(spec: TuneSpec, candidate: Candidate, result) -> TrialOutcome:
    """Throughput (median of measured epochs) and whether the trial may win."""
    if result.error is not None:
        message = str(result.error).strip().splitlines()
        return TrialOutcome(candidate, "failed", detail=_last_error_line(message))
    frame = result.metrics_dataframe
    if frame is None or METRIC not in frame or frame.empty:
        return TrialOutcome(candidate, "failed", detail="reported no metrics")
    epochs = len(frame)
    measured = frame.iloc[spec.trial.warmup_epochs :]
    if measured.empty:
        measured = frame
    outcome = TrialOutcome(
        candidate,
        "ok",
        samples_per_s=statistics.median(measured[METRIC].tolist()),
        step_ms=_median_of(measured, "step_ms"),
        data_wait_ms=_median_of(measured, "step_data_wait_ms"),
        peak_rss_mb=float(frame["peak_rss_mb"].max()),
        peak_device_mb=_max_of(frame, DEVICE_PEAK),
        epochs=epochs,
        metrics={k: float(v) for k, v in frame.iloc[-1].items() if _is_number(v)},
    )
    if epochs < spec.trial.epochs:
        outcome.status, outcome.detail = "stopped early", f"ASHA stopped it after {epochs} epochs"
    losses = frame["train_loss"].tolist()
    if spec.constraints.require_falling_loss and not losses[-1] < losses[0]:
        outcome.status = "rejected"
        outcome.detail = f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})"
    elif outcome.peak_memory_mb > spec.constraints.memory_mb_per_worker:
        kind = "device" if outcome.peak_device_mb is not None else "worker"
        outcome.status = "rejected"
        outcome.detail = (
            f"peak {kind} memory {outcome.peak_memory_mb:.0f} MB over the "
            f"{spec.constraints.memory_mb_per_worker:.0f} MB budget"
        )
    return outcome


#: The largest worker's peak GPU memory, which GPU trials report (`raylane.train.loop`).
DEVICE_PEAK = "worker_device_peak_mb"


def _median_of(frame, column: str) -> float | None:
    return statistics.median(frame[column].tolist()) if column in frame else None


def _max_of(frame, column: str) -> float | None:
    """The column's largest value, or None where no epoch reported it (a CPU trial)."""
    if column not in frame or frame[column].isna().all():
        return None
    return float(frame[column].max())


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _last_error_line(lines: list[str]) -> str:
    meaningful = [line.strip() for line in lines if line.strip() and "^" not in line]
    return meaningful[-1][:300] if meaningful else "unknown error"


@contextlib.contextmanager
def _tune_console(show: bool):
    """Tune's own console output only with --verbose. At verbose=0 its current output engine
    still prints an experiment box and paths; its classic one prints nothing, so pick that."""
    saved = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "1" if show else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = saved


def _check_cluster_fits(spec: TuneSpec) -> None:
    """A budget larger than the cluster would leave trials waiting for workers forever."""
    import ray

    cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
    if spec.constraints.cpus > cluster_cpus + 1e-9:
        raise ConfigError(
            f"constraints.cpus is {spec.constraints.cpus:g} but the Ray cluster has "
            f"{cluster_cpus:g} CPUs: lower it (--set constraints.cpus={cluster_cpus:g})"
        )


def run_search(spec: TuneSpec) -> SearchOutcome:
    """Measure the candidates, one trial at a time, with ASHA early stopping: the `top_k`
    predicted fastest (after a profile), or every valid one when prediction is off.

    Trials never overlap: on a small cluster, concurrent trials share cores and their measured
    throughputs would rank the layouts wrongly.
    """
    candidates, pruned = enumerate_candidates(spec)
    log.info(
        "%d candidate layouts to measure, %d pruned (reasons in the table at the end)",
        len(candidates),
        len(pruned),
    )
    for item in pruned:
        log.debug("pruned %s: %s", item.candidate.key, item.reason)
    if not candidates:
        return SearchOutcome([], pruned, 0.0)
    _check_cluster_fits(spec)
    ensure_dataset(trial_config(spec, candidates[0]))

    start = time.perf_counter()
    plan = _Plan(candidates, pruned)
    if spec.predict.enabled:
        plan = _predict(spec, plan)
        if not plan.launch:
            return SearchOutcome(
                [], plan.pruned, time.perf_counter() - start, plan.not_run, plan.profile_run_id,
                plan.profile_s,
            )  # fmt: skip

    by_key = {c.key: c for c in plan.launch}
    tuner, searcher = _tuner(spec, by_key, plan.predictions)
    with _tune_console(verbose()):
        grid = tuner.fit()
    wall_s = time.perf_counter() - start
    trials = [_judge(spec, by_key[result.config["key"]], result) for result in grid]
    for trial in trials:
        trial.predicted = plan.predictions.get(trial.candidate.key)
    calibration = _calibrate(trials, list(by_key)) if plan.predictions else None
    not_run = plan.not_run
    if searcher is not None:
        skipped = [
            TrialOutcome(by_key[k], "not run", detail=why, predicted=plan.predictions[k])
            for k, why in searcher.skipped.items()
        ]
        not_run = skipped + not_run  # predicted faster than the rest of not_run
    if calibration is not None:
        for item in not_run:
            item.predicted = calibration.apply(plan.predictions[item.candidate.key])
    return SearchOutcome(
        trials, plan.pruned, wall_s, not_run, plan.profile_run_id, plan.profile_s, calibration,
        dict(plan.predictions),
    )  # fmt: skip


@dataclass
class _Plan:
    """What a search will launch, and what it ruled out before launching anything."""

    launch: list[Candidate]
    pruned: list[Pruned]
    not_run: list[TrialOutcome] = field(default_factory=list)
    predictions: dict[str, LocalPrediction] = field(default_factory=dict)
    profile_run_id: str | None = None
    profile_s: float = 0.0


def _predict(spec: TuneSpec, plan: _Plan) -> _Plan:
    """Profile, predict every candidate, and keep the `top_k` predicted fastest to launch."""
    ranking = rank_candidates(spec, plan.launch)
    predictions = ranking.predictions
    not_run = [
        TrialOutcome(
            c, "not run", detail="predicted slower than the top k", predicted=predictions[c.key]
        )
        for c in ranking.not_run
    ]
    log.info(
        "measuring up to the %d predicted fastest, best first: %s",
        len(ranking.launch),
        ", ".join(c.key for c in ranking.launch),
    )
    return _Plan(
        ranking.launch, plan.pruned + ranking.pruned, not_run, predictions,
        ranking.profile_run_id, ranking.profile_s,
    )  # fmt: skip


def _tuner(spec: TuneSpec, by_key: dict[str, Candidate], predictions):
    """`(Tuner, searcher)`: one trial at a time, best predicted first when there are
    predictions (`PredictedFirst`, which also stops early), else a grid."""
    from ray import tune

    configs = {key: trial_config(spec, c).model_dump(mode="json") for key, c in by_key.items()}
    searcher = None
    if predictions:
        searcher = PredictedFirst(
            list(by_key), predictions, spec.predict.margin, spec.trial.warmup_epochs, METRIC
        )
    tuner = tune.Tuner(
        # The driver only waits on its Train workers: a sliver of CPU, so workers can start.
        tune.with_resources(
            tune.with_parameters(trial_driver, configs=configs), {"CPU": TRIAL_DRIVER_CPU}
        ),
        param_space=None if searcher else {"key": tune.grid_search(list(by_key))},
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="max",
            scheduler=_scheduler(spec),
            search_alg=searcher,
            num_samples=len(by_key) if searcher else 1,
            max_concurrent_trials=1,
        ),
        run_config=tune.RunConfig(
            name=f"{spec.experiment}-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=str(spec.storage_path.resolve()),
            # raylane prints one line per trial; Tune's own status tables only with --verbose.
            verbose=1 if verbose() else 0,
            callbacks=[TrialProgress(len(by_key), spec.trial.epochs)],
        ),
    )
    return tuner, searcher


def _calibrate(trials: list[TrialOutcome], order: list[str]) -> Calibration | None:
    """Correct every prediction by the measured trials (the median of their measured /
    predicted ratios: `raylane.tune.calibration.pooled`): the profile times the model alone,
    while a run also feeds it through Ray Data, whose threads share the cores (a factor on
    the step's work) and whose wait is part of the step (added per step). A measured trial's
    own prediction is calibrated by the others (when there are others), so the error shown next
    to it is one the calibration did not fit."""
    by_key = {t.candidate.key: t for t in trials}
    own = {
        key: measured_calibration(
            key, by_key[key].predicted, by_key[key].step_ms, by_key[key].data_wait_ms,
            by_key[key].peak_memory_mb,
        )
        for key in order
        if key in by_key and by_key[key].step_ms and by_key[key].predicted
    }  # fmt: skip
    if not own:
        return None
    calibration = pooled(list(own.values()))
    for trial in trials:
        if trial.predicted is not None:
            others = [c for key, c in own.items() if key != trial.candidate.key]
            trial.predicted = (pooled(others) if others else calibration).apply(trial.predicted)
    return calibration
