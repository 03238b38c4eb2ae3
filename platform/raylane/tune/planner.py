"""`raylane tune`: search, then leave the ranked table, CSV, plot, MLflow runs and best config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from raylane.tune.report import (
    log_to_mlflow,
    print_table,
    scaling_plot,
    write_best_config,
    write_csv,
)
from raylane.tune.search import SearchOutcome, run_search
from raylane.tune.spec import TuneSpec


@dataclass(frozen=True)
class PlanResult:
    outcome: SearchOutcome
    csv_path: Path
    plot_path: Path
    best_config: Path | None
    mlflow_run_id: str


def plan(spec: TuneSpec, console: Console) -> PlanResult:
    """Run the search and write its outputs. Expects Ray to be connected."""
    outcome = run_search(spec)
    print_table(outcome, console)
    out = spec.output_dir
    csv_path = write_csv(outcome, out / f"{spec.experiment}-trials.csv")
    plot_path = scaling_plot(outcome, out / f"{spec.experiment}-scaling.png")
    files = [csv_path, plot_path]
    best = None
    if outcome.winner is not None:
        best = write_best_config(spec, outcome.winner, out / f"{spec.experiment}-best.yaml")
        files.append(best)
        console.print(
            f"winner: {outcome.winner.candidate.key} at {outcome.winner.samples_per_s:.1f} "
            f"samples/s -> {best}",
            highlight=False,
        )
    else:
        console.print("no trial met the constraints: no winner", style="bold red")
    run_id = log_to_mlflow(spec, outcome, files)
    console.print(f"trials: {csv_path}  plot: {plot_path}  MLflow run: {run_id}", highlight=False)
    return PlanResult(outcome, csv_path, plot_path, best, run_id)
