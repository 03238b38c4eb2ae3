"""The tracking store a command reads (`raylane runs`, `models`, `logs`, `compare`,
`reproduce`): which one, whether it holds anything, and a run by its id or a prefix of it.

MLflow is imported only once the arguments are checked and the store is known to exist: a
missing SQLite file or `file:` folder is reported in one line instead of MLflow creating an
empty store there.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from raylane.cli.common import fail, load
from raylane.config import ConfigError, parse_overrides
from raylane.config.loader import validate_config
from raylane.tracking import TrackingError, check_tracking_reachable, resolve_tracking_uri

#: Characters of a run id `raylane runs` shows; `find_run` takes any prefix from 6 on.
SHORT_ID = 12
MIN_PREFIX = 6


def store_uri(config: Path | None, overrides: list[str] | None) -> str:
    """The tracking URI of `config` (with its `--set`s), or without a config that of the
    `--set tracking.*` keys, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    if config is not None:
        return resolve_tracking_uri(load(config, overrides).tracking.tracking_uri)
    try:
        return resolve_tracking_uri(_overrides_alone(overrides or []).tracking.tracking_uri)
    except ConfigError as exc:
        raise fail(str(exc)) from None


def _overrides_alone(overrides: list[str]):
    """A run config of defaults with only `overrides` applied (no file to read)."""
    texts = {item.partition("=")[0].strip(): item.strip() for item in overrides}
    tree: dict[str, Any] = {"experiment": "raylane"}
    for dotted, value in parse_overrides(overrides).items():
        node = tree
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {texts[dotted]}: {part} is not a section")
        node[leaf] = value
    return validate_config(tree, "--set", overrides=texts)


def open_store(uri: str):
    """An MLflow client of the store at `uri`; one `error:` line when there is none."""
    local = _local_path(uri)
    if local is not None and not local.exists():
        raise fail(
            f"no MLflow tracking store at {uri} (nothing tracked there yet; point "
            "tracking.tracking_uri or $MLFLOW_TRACKING_URI at one)"
        )
    try:
        check_tracking_reachable(uri)
    except TrackingError as exc:
        raise fail(str(exc)) from None
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _local_path(uri: str) -> Path | None:
    """The file or folder a local store lives in (None for a server)."""
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///"))
    if uri.startswith("file:"):
        return Path(unquote(urlparse(uri).path))
    return None


def experiment_ids(client, uri: str, name: str | None = None) -> list[str]:
    """The ids of every experiment in the store, or of the one named `name`."""
    experiments = client.search_experiments()
    if name is None:
        return [experiment.experiment_id for experiment in experiments]
    for experiment in experiments:
        if experiment.name == name:
            return [experiment.experiment_id]
    known = ", ".join(sorted(experiment.name for experiment in experiments)) or "none"
    raise fail(f"no experiment {name!r} in {uri} (experiments: {known})")


def find_run(client, uri: str, run: str):
    """The run whose id is `run` or starts with it (at least 6 characters, one match)."""
    if len(run) < MIN_PREFIX or not set(run.lower()) <= set(string.hexdigits):
        raise fail(f"run {run!r}: expected a run id, or its first {MIN_PREFIX} or more characters")
    if len(run) == 32:
        try:
            return client.get_run(run)
        except Exception:  # noqa: BLE001 - MLflow's not-found error is several lines long
            raise fail(f"run {run}: no such run in {uri}") from None
    found = client.search_runs(
        experiment_ids(client, uri),
        filter_string=f"attributes.run_id LIKE '{run.lower()}%'",
        max_results=2,
    )
    if not found:
        raise fail(f"run {run}: no run id starts so in {uri}")
    if len(found) > 1:
        raise fail(f"run {run}: more than one run id starts so; give more of it")
    return found[0]
