"""`raylane compare` and `reproduce`: what a run recorded, again."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.table import Table

from raylane.cli.common import TrackingUriOption, VerboseOption, console, fail, setup_logging
from raylane.cli.lazy import deferred
from raylane.cli.running import on_ray, user_mistakes
from raylane.cli.store import SHORT_ID, find_run, open_store
from raylane.tracking import resolve_tracking_uri

# MLflow and torch (a run's weights): loaded once the arguments are checked.
compare_runs = deferred("raylane.tracking.compare")
reproduction = deferred("raylane.reproduce")


def _run_argument(metavar: str):
    return Annotated[
        str, typer.Argument(metavar=metavar, help="Run id, or its first 6 or more characters.")
    ]


def compare(
    run_a: _run_argument("RUN_A"),
    run_b: _run_argument("RUN_B"),
    tracking_uri: TrackingUriOption = None,
) -> None:
    """What differs between two training runs.

    Code, data, versions, cluster, config keys, final metrics and weights.

    Example: raylane compare 3f2a9c01b7d4 8e1d0a6c5b2f
    """
    uri = resolve_tracking_uri(tracking_uri)
    client = open_store(uri)
    run_a, run_b = (find_run(client, uri, run).info.run_id for run in (run_a, run_b))
    try:
        records = [compare_runs.run_record(client, run) for run in (run_a, run_b)]
    except Exception as exc:  # an artifact the store cannot hand back
        raise fail(str(exc).splitlines()[0]) from None
    found = compare_runs.differences(*records)
    if not found:
        console.print(
            f"runs {run_a} and {run_b} agree in {', '.join(compare_runs.SECTIONS)}", highlight=False
        )
        return
    table = Table(title=f"{len(found)} differences")
    for name in ("section", "key", run_a[:SHORT_ID], run_b[:SHORT_ID]):
        table.add_column(name, overflow="fold")
    for item in found:
        table.add_row(item.section, item.key, item.a, item.b)
    console.print(table)


def reproduce(
    run_id: Annotated[
        str,
        typer.Argument(
            metavar="RUN", help="The training run to repeat: its id, or its first 6+ characters."
        ),
    ],
    allow_drift: Annotated[
        bool, typer.Option(help="Run even when code, data, versions or cluster differ.")
    ] = False,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Re-run a training run from MLflow alone and say whether it came out identical.

    Example: raylane reproduce 3f2a9c01b7d4
    """
    setup_logging(verbose)
    if tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    uri = resolve_tracking_uri(tracking_uri)
    client = open_store(uri)
    run_id = find_run(client, uri, run_id).info.run_id
    with user_mistakes():  # a custom model's factory goes to a running cluster's nodes
        ship = reproduction.recorded_config(client, run_id).model.factory_source()
    with on_ray(reproduction.DriftError, ship=ship):
        result = reproduction.reproduce(client, run_id, allow_drift=allow_drift, show=console.print)
    console.print(
        f"{result.verdict}{': ' + result.detail if result.detail else ''} "
        f"(run {result.run_id} reproduces {run_id})",
        highlight=False,
        style="bold green" if result.verdict == "identical" else "bold red",
    )
    if result.verdict != "identical":
        raise typer.Exit(1)
