"""What a search leaves behind: a ranked table, a CSV, a scaling plot, MLflow runs (a parent
and one nested run per trial) and the winner as a runnable training config."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from statistics import median

import yaml
from rich.console import Console
from rich.table import Table

from raylane.config.loader import flatten
from raylane.plan.report import changed_from_defaults
from raylane.tracking import resolve_tracking_uri
from raylane.train.phases import MARK_PREFIX
from raylane.tune.candidates import trial_config
from raylane.tune.search import SearchOutcome, TrialOutcome
from raylane.tune.spec import TuneSpec

COLUMNS = ["rank", "layout", "strategy", "workers", "dp", "pp", "tp", "cp", "sequence_parallel",
           "microbatches", "batch_size", "grad_compression", "activation_checkpointing",
           "samples_per_s", "peak_rss_mb", "peak_device_mb",
           "train_loss", "step_ms", "compute_ms", "comm_ms", "bubble_ms", "data_wait_ms",
           "comm_bytes_per_step", "predicted_samples_per_s", "predicted_step_ms",
           "measured_step_ms", "step_error", "predicted_memory_mb", "epochs", "status",
           "detail"]  # fmt: skip
# The step-time split and bytes sent, from each trial's last epoch (raylane.tracking.step_times).
SPLIT = {"step_ms": "step_ms", "compute_ms": "step_compute_ms", "comm_ms": "step_comm_ms",
         "bubble_ms": "step_bubble_ms", "data_wait_ms": "step_data_wait_ms",
         "comm_bytes_per_step": "comm_bytes_per_step"}  # fmt: skip


def _rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _row(rank: int | str, trial: TrialOutcome) -> dict:
    o = trial.candidate.overrides
    return {
        "rank": rank,
        "layout": trial.candidate.key,
        "strategy": o["parallelism.strategy"],
        "workers": o["parallelism.workers"],
        "dp": o["parallelism.dp"],
        "pp": o["parallelism.pp"],
        "tp": o.get("parallelism.tp", 1),
        "cp": o.get("parallelism.cp", 1),
        "sequence_parallel": o.get("parallelism.sequence_parallel", False),
        "microbatches": o["parallelism.microbatches"],
        "batch_size": o["training.batch_size"],
        "grad_compression": o["parallelism.grad_compression"],
        "activation_checkpointing": o["training.activation_checkpointing"],
        "samples_per_s": None if trial.samples_per_s is None else round(trial.samples_per_s, 1),
        "peak_rss_mb": None if trial.peak_rss_mb is None else round(trial.peak_rss_mb),
        "peak_device_mb": None if trial.peak_device_mb is None else round(trial.peak_device_mb),
        "train_loss": trial.metrics.get("train_loss"),
        **{column: _rounded(trial.metrics.get(key)) for column, key in SPLIT.items()},
        **_predicted_columns(trial),
        "epochs": trial.epochs,
        "status": trial.status,
        "detail": trial.detail,
    }


def _predicted_columns(trial: TrialOutcome) -> dict:
    predicted = trial.predicted
    return {
        "predicted_samples_per_s": None if predicted is None else round(predicted.samples_per_s, 1),
        "predicted_step_ms": None if predicted is None else round(predicted.step_ms, 2),
        "measured_step_ms": _rounded(trial.step_ms),
        "step_error": _rounded(trial.step_error, 3),
        "predicted_memory_mb": None if predicted is None else round(predicted.memory_mb),
    }


def rows(outcome: SearchOutcome) -> list[dict]:
    ranked = [_row(i + 1, t) for i, t in enumerate(outcome.ranked)]
    ranked += [_row("-", t) for t in outcome.not_run]
    for item in outcome.pruned:
        pruned = TrialOutcome(item.candidate, "pruned", detail=item.reason)
        ranked.append(_row("-", pruned))
    return ranked


def print_table(outcome: SearchOutcome, console: Console) -> None:
    """The measured trials, ranked; then the pruned layouts grouped by reason (the CSV has
    every row)."""
    title = (f"parallelism search: {len(outcome.trials)} trials in {outcome.wall_s:.0f} s, "
             f"{len(outcome.not_run)} predicted slower, {len(outcome.pruned)} pruned")  # fmt: skip
    # Measured, then (predicted) where there is a prediction: predicted-only rows show it alone.
    names = ("rank", "layout", "samples/s (pred)", "step ms (pred)", "peak MB (pred)",
             "train_loss", "compute ms", "comm ms", "bubble ms", "status")  # fmt: skip
    table = Table(title=title)
    for name in names:
        left = name in ("layout", "status")
        table.add_column(name, justify="left" if left else "right", no_wrap=name == "layout")
    listed = [(str(i), t) for i, t in enumerate(outcome.ranked, start=1)]
    listed += [("-", t) for t in outcome.not_run]
    for rank, trial in listed:
        loss = trial.metrics.get("train_loss")
        predicted = trial.predicted
        table.add_row(
            rank,
            trial.candidate.key,
            _pair(trial.samples_per_s, predicted and predicted.samples_per_s, ".1f"),
            _pair(trial.step_ms, predicted and predicted.step_ms, ".1f"),
            _pair(trial.peak_memory_mb, predicted and predicted.memory_mb, ".0f"),
            "" if loss is None else f"{loss:.4f}",
            *(_ms(trial.metrics.get(f"step_{part}_ms")) for part in ("compute", "comm", "bubble")),
            trial.status + (f": {trial.detail}" if trial.detail else ""),
        )
    console.print(table)
    if outcome.profile_run_id is not None:
        console.print(prediction_summary(outcome), highlight=False)
    by_reason: dict[str, list[str]] = defaultdict(list)
    for item in outcome.pruned:
        by_reason[item.reason].append(item.candidate.key)
    for reason, keys in by_reason.items():
        console.print(f"pruned {len(keys)} ({reason}): {', '.join(keys)}", highlight=False)


def prediction_summary(outcome: SearchOutcome) -> str:
    """Where the predictions come from and how far off they were for the measured trials,
    each calibrated by the others (one trial alone matches by construction)."""
    summary = f"predictions: profile run {outcome.profile_run_id}"
    calibration = outcome.calibration
    if calibration is None:
        return summary + " (not calibrated: no trial measured)"
    summary += (
        f", step work x{calibration.step_scale:.2f}, input wait "
        f"{calibration.data_wait_s * 1e3:.1f} ms per step and memory "
        f"{calibration.memory_offset_mb or 0.0:+.0f} MB from {calibration.source()}"
    )
    alone = calibration.layouts if len(calibration.layouts) == 1 else ()
    errors = [
        abs(t.step_error)
        for t in outcome.trials
        if t.step_error is not None and t.candidate.key not in alone
    ]
    if errors:
        summary += (
            f"; median |predicted - measured| step time, each by the others: {median(errors):.0%}"
        )
    return summary


def _ms(value: float | None) -> str:
    return _number(value, ".1f")


def _pair(measured: float | None, predicted: float | None, spec: str) -> str:
    if predicted is None:
        return _number(measured, spec)
    if measured is None:
        return f"({predicted:{spec}})"
    return f"{measured:{spec}} ({predicted:{spec}})"


def _number(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def write_csv(outcome: SearchOutcome, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows(outcome))
    return path


def scaling_plot(outcome: SearchOutcome, path: Path) -> Path:
    """Best throughput and scaling efficiency per world size, one line per strategy.

    Efficiency = throughput / (world size x the best one-worker throughput of any strategy);
    without a one-worker trial, the smallest world size measured is the reference.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[str, dict[int, float]] = defaultdict(dict)
    for trial in outcome.trials:
        if trial.samples_per_s is None or trial.status == "failed":
            continue
        strategy = trial.candidate.overrides["parallelism.strategy"]
        world = trial.world_size
        best[strategy][world] = max(best[strategy].get(world, 0.0), trial.samples_per_s)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    all_points = [(w, v) for per in best.values() for w, v in per.items()]
    if all_points:
        smallest = min(w for w, _ in all_points)
        reference = max(v for w, v in all_points if w == smallest) / smallest
        for strategy, per in sorted(best.items()):
            worlds = sorted(per)
            left.plot(worlds, [per[w] for w in worlds], marker="o", label=strategy)
            right.plot(worlds, [per[w] / (w * reference) for w in worlds], marker="o",
                       label=strategy)  # fmt: skip
    left.set(xlabel="world size (workers)", ylabel="samples/s", title="throughput")
    right.set(xlabel="world size (workers)", ylabel="efficiency", title="scaling efficiency")
    right.axhline(1.0, color="grey", linewidth=0.5)
    for axis in (left, right):
        axis.legend() if all_points else None
        axis.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_best_config(spec: TuneSpec, winner: TrialOutcome, path: Path) -> Path:
    """The winner as a runnable training config: the base with the winning layout (for full
    epochs, not the trial's), written as the fields that differ from the defaults and the
    layout's, as `raylane plan` writes its configs; it loads to the same config."""
    cfg = trial_config(spec, winner.candidate, for_trial=False)
    header = (
        f"# Generated by `raylane tune` ({spec.experiment}): the best measured layout,\n"
        f"# {winner.candidate.key} at {winner.samples_per_s:.1f} samples/s in its trial.\n"
        f"# Run it: raylane train --config {path}\n"
        "# Fields at their defaults are left out, except the layout's.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    written = changed_from_defaults(cfg)
    path.write_text(header + yaml.safe_dump(written, sort_keys=False))
    return path


def log_to_mlflow(spec: TuneSpec, outcome: SearchOutcome, files: list[Path]) -> str:
    """A parent run for the search, one nested run per trial; returns the parent's id."""
    import mlflow

    mlflow.set_tracking_uri(resolve_tracking_uri(spec.tracking_uri))
    mlflow.set_experiment(spec.experiment)
    with mlflow.start_run(run_name=f"{spec.experiment}-search") as parent:
        mlflow.log_params(
            {k: str(v)[:500] for k, v in flatten(spec.model_dump(mode="json")).items()}
        )
        mlflow.log_metrics({"trials": len(outcome.trials), "pruned": len(outcome.pruned),
                            "not_run": len(outcome.not_run), "search_wall_s": outcome.wall_s,
                            "profile_s": outcome.profile_s})  # fmt: skip
        if outcome.profile_run_id is not None:
            mlflow.set_tag("raylane.profile_run", outcome.profile_run_id)
        if outcome.calibration is not None:
            mlflow.log_metric("prediction_step_scale", outcome.calibration.step_scale)
        if outcome.winner is not None:
            mlflow.set_tag("raylane.winner", outcome.winner.candidate.key)
            mlflow.log_metric("best_samples_per_s", outcome.winner.samples_per_s)
        for path in files:
            mlflow.log_artifact(str(path))
        for trial in [*outcome.trials, *outcome.not_run]:
            with mlflow.start_run(run_name=trial.candidate.key, nested=True):
                mlflow.log_params({k: str(v) for k, v in trial.candidate.overrides.items()})
                mlflow.set_tags({"raylane.trial_status": trial.status,
                                 "raylane.trial_detail": trial.detail[:500]})  # fmt: skip
                metrics = {
                    k: v
                    for k, v in trial.metrics.items()
                    if k != "epoch" and not k.startswith(MARK_PREFIX)
                }
                if trial.predicted is not None:
                    metrics["predicted_step_ms"] = trial.predicted.step_ms
                    metrics["predicted_samples_per_s"] = trial.predicted.samples_per_s
                    metrics["predicted_memory_mb"] = trial.predicted.memory_mb
                    metrics["predicted_activation_mb"] = trial.predicted.activation_mb
                    # The predicted split (ring included) beside the measured step_*_ms.
                    for part, seconds in trial.predicted.parts.items():
                        metrics[f"predicted_step_{part}_ms"] = 1000 * seconds
                if trial.step_error is not None:
                    metrics["step_error"] = trial.step_error
                if trial.samples_per_s is not None:
                    metrics["samples_per_s"] = trial.samples_per_s
                    metrics["scaling_efficiency_per_worker"] = (
                        trial.samples_per_s / trial.world_size
                    )
                mlflow.log_metrics(metrics)
    return parent.info.run_id
