"""`raylane runs`, `models` and `logs`: what the tracking store holds, read without Ray."""

from __future__ import annotations

import sys
import tempfile
from datetime import datetime
from difflib import get_close_matches
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from raylane.cli.common import StoreConfigOption, StoreSetOption, fail
from raylane.cli.store import SHORT_ID, experiment_ids, find_run, open_store, store_uri
from raylane.tracking.worker_logs import LOG_DIR

#: The metrics `raylane runs` shows, each where at least one listed run has it.
KEY_METRICS = ("val_loss", "val_accuracy")
#: Artifacts `raylane logs --artifact` can print, by suffix.
TEXT_SUFFIXES = (".out", ".err", ".log", ".txt", ".yaml", ".json", ".patch", ".md")


def runs(
    experiment: Annotated[
        str | None, typer.Option("--experiment", "-e", help="Only this MLflow experiment.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="Runs to show.")] = 20,
    config: StoreConfigOption = None,
    overrides: StoreSetOption = None,
) -> None:
    """List tracked runs, newest first: status, start, strategy, key metrics.

    A run's id is shown by its first 12 characters; `raylane logs`, `compare` and
    `reproduce` take that prefix as well as the whole id.

    Example: raylane runs --experiment digits-ddp --limit 5
    """
    uri = store_uri(config, overrides)
    client = open_store(uri)
    found = client.search_runs(
        experiment_ids(client, uri, experiment),
        max_results=limit,
        order_by=["attributes.start_time DESC"],
    )
    if not found:
        where = f"experiment {experiment!r} of {uri}" if experiment else uri
        raise fail(f"no runs in {where}", code=1)
    metrics = [key for key in KEY_METRICS if any(key in run.data.metrics for run in found)]
    table = _table("run", "started", "status", "strategy", *metrics, "name")
    for run in found:
        values = run.data.metrics
        table.add_row(
            run.info.run_id[:SHORT_ID],
            _when(run.info.start_time),
            run.info.status.lower(),
            run.data.tags.get("raylane.strategy", "-"),
            *(f"{values[key]:.4f}" if key in values else "-" for key in metrics),
            run.info.run_name or "-",
        )
    _print(table)


def models(
    name: Annotated[
        str | None,
        typer.Argument(metavar="NAME", help="A registered model: list its versions."),
    ] = None,
    config: StoreConfigOption = None,
    overrides: StoreSetOption = None,
) -> None:
    """List registered models (or one model's versions), aliases, source runs.

    Example: raylane models raylane-digits
    """
    uri = store_uri(config, overrides)
    client = open_store(uri)
    registered = {model.name: model for model in client.search_registered_models()}
    if not registered:
        raise fail(f"no registered models in {uri}", code=1)
    if name is None:
        _print_models(client, registered)
        return
    if name not in registered:
        close = get_close_matches(name, registered, n=1)
        hint = f"did you mean {close[0]}?" if close else f"models: {', '.join(sorted(registered))}"
        raise fail(f"no registered model {name!r} in {uri} ({hint})")
    aliases = _aliases_by_version(registered[name])
    table = _table("version", "aliases", "created", "source run")
    for version in sorted(_versions(client, name), key=lambda v: -int(v.version)):
        table.add_row(
            f"v{version.version}",
            aliases.get(str(version.version), "-"),
            _when(version.creation_timestamp),
            (version.run_id or "-")[:SHORT_ID],
        )
    _print(table)


def _print_models(client, registered: dict) -> None:
    """One row per registered model: how many versions, the latest, the aliases."""
    table = _table("model", "versions", "latest", "aliases", "source run")
    for name in sorted(registered):
        versions = _versions(client, name)
        latest = max(versions, key=lambda v: int(v.version), default=None)
        aliases = registered[name].aliases
        table.add_row(
            name,
            str(len(versions)),
            f"v{latest.version}" if latest else "-",
            ", ".join(f"{alias}: v{v}" for alias, v in sorted(aliases.items())) or "-",
            (latest.run_id or "-")[:SHORT_ID] if latest else "-",
        )
    _print(table)


def logs(
    run: Annotated[
        str, typer.Argument(metavar="RUN", help="Run id, or its first 6 or more characters.")
    ],
    rank: Annotated[int | None, typer.Option(min=0, help="Only this worker rank's output.")] = None,
    artifact: Annotated[
        str | None,
        typer.Option(help="Print this text artifact instead, e.g. config/resolved.yaml."),
    ] = None,
    config: StoreConfigOption = None,
    overrides: StoreSetOption = None,
) -> None:
    """Print a run's worker console logs (stdout, stderr) as MLflow keeps them.

    `raylane train` logs each worker rank's output as logs/rank-N.out and .err
    when the fit ends; --artifact prints any other text artifact of the run.

    Example: raylane logs 3f2a9c01b7d4 --rank 0
    """
    uri = store_uri(config, overrides)
    client = open_store(uri)
    run_id = find_run(client, uri, run).info.run_id
    texts = _text_artifacts(client, run_id)
    if artifact is not None:
        if artifact not in texts:
            raise fail(
                f"run {run_id[:SHORT_ID]} has no text artifact {artifact!r} ({_listed(texts)})"
            )
        wanted = [artifact]
    else:
        prefix = f"{LOG_DIR}/rank-{'' if rank is None else rank}"
        wanted = [path for path in texts if path.startswith(prefix)]
    if not wanted:
        what = "console logs" if rank is None else f"console logs of rank {rank}"
        raise fail(f"run {run_id[:SHORT_ID]} logged no {what} ({_listed(texts)})", code=1)
    with tempfile.TemporaryDirectory() as scratch:
        for path in wanted:
            text = Path(client.download_artifacts(run_id, path, scratch)).read_text(
                errors="replace"
            )
            if artifact is None:
                sys.stdout.write(f"==> {path} <==\n")
            sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _text_artifacts(client, run_id: str, path: str | None = None, depth: int = 3) -> list[str]:
    """The run's text artifacts (by suffix), folders `depth` deep."""
    found = []
    for entry in client.list_artifacts(run_id, path):
        if entry.is_dir and depth > 1:
            found += _text_artifacts(client, run_id, entry.path, depth - 1)
        elif not entry.is_dir and entry.path.endswith(TEXT_SUFFIXES):
            found.append(entry.path)
    return sorted(found)


def _listed(texts: list[str]) -> str:
    return f"text artifacts: {', '.join(texts)}" if texts else "no text artifacts"


def _versions(client, name: str) -> list:
    return list(client.search_model_versions(f"name = '{name}'"))


def _aliases_by_version(model) -> dict[str, str]:
    """'version' -> 'alias, alias' of a registered model."""
    by_version: dict[str, list[str]] = {}
    for alias, version in sorted(model.aliases.items()):
        by_version.setdefault(str(version), []).append(alias)
    return {version: ", ".join(names) for version, names in by_version.items()}


def _when(milliseconds: int | None) -> str:
    if not milliseconds:
        return "-"
    return datetime.fromtimestamp(milliseconds / 1000).strftime("%Y-%m-%d %H:%M")


def _table(*columns: str) -> Table:
    """A table with a rule under its header and no frame."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for column in columns:
        table.add_column(column, no_wrap=True)
    return table


def _print(table: Table) -> None:
    """One line per row however narrow the terminal (a listing to read, grep or paste from):
    wider than the console, the table is printed at its own width."""
    out = Console()
    needed = out.measure(table, options=out.options.update_width(10_000)).maximum
    if needed > out.width:
        out = Console(width=needed)
    out.print(table)
