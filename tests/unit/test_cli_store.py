"""The commands that read the tracking store, on a small SQLite store made here with MLflow's
client: `raylane runs`, `models`, `logs`, run ids by prefix (`compare`, `reproduce`), `promote
[MODEL] VERSION`, and one line when the store is missing or holds nothing. No Ray is started."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from raylane.cli import app

from .test_config import ROOT

T0 = 1_780_000_000_000  # runs' start times (ms): the listing is newest first


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two experiments, four runs (one failed, one without logs), two registered models."""
    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    digits = client.create_experiment("digits-ddp", artifact_location=str(root / "artifacts"))
    lm = client.create_experiment("lm-serve", artifact_location=str(root / "artifacts"))
    runs = {}
    for minute, (experiment, name, strategy, loss, status) in enumerate([
        (digits, "digits-a", "ddp", 0.5, "FINISHED"),
        (digits, "digits-b", "fsdp", 0.25, "FINISHED"),
        (digits, "digits-c", "ddp", None, "FAILED"),
        (lm, "lm-a", "pipeline", 1.5, "FINISHED"),
    ]):  # fmt: skip
        run = client.create_run(
            experiment, start_time=T0 + minute * 60_000, run_name=name,
            tags={"raylane.strategy": strategy},
        )  # fmt: skip
        run_id = run.info.run_id
        if loss is not None:
            client.log_metric(run_id, "val_loss", loss)
        if experiment == digits:
            client.log_text(run_id, f"{name} rank 0 epoch 1\n", "logs/rank-0.out")
            client.log_text(run_id, f"{name} rank 1 warning\n", "logs/rank-1.err")
        client.log_text(run_id, f"experiment: {name}\n", "config/resolved.yaml")
        client.set_terminated(run_id, status=status)
        runs[name] = run_id
    for model, sources in (("raylane-digits", ["digits-a", "digits-b"]), ("raylane-lm", ["lm-a"])):
        client.create_registered_model(model)
        for source in sources:
            client.create_model_version(model, f"runs:/{runs[source]}/model", runs[source])
        client.set_registered_model_alias(model, "champion", "1")
    return uri, runs, client


def _raylane(*args: str, uri: str | None = None):
    env = {"COLUMNS": "120", "RAY_ADDRESS": None, "MLFLOW_TRACKING_URI": uri}
    return CliRunner().invoke(app, list(args), env=env)


def _rows(output: str) -> list[list[str]]:
    """A listing's rows after its header rule, split on runs of two or more spaces."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("─")) + 1
    return [[cell for cell in line.strip().split("  ") if cell] for line in lines[start:]]


def _cells(row: list[str]) -> list[str]:
    return [cell.strip() for cell in row]


def test_runs_lists_newest_first_with_status_strategy_and_metrics(store):
    uri, runs, _ = store
    result = _raylane("runs", "--set", f"tracking.tracking_uri={uri}")
    assert result.exit_code == 0, result.output
    header = result.output.splitlines()[0].split()
    assert header == ["run", "started", "status", "strategy", "val_loss", "name"]
    rows = [_cells(row) for row in _rows(result.output)]
    assert [row[-1] for row in rows] == ["lm-a", "digits-c", "digits-b", "digits-a"]
    assert rows[1][0] == runs["digits-c"][:12] and rows[1][2:5] == ["failed", "ddp", "-"]
    assert rows[2][2:5] == ["finished", "fsdp", "0.2500"]
    only = _raylane("runs", "--experiment", "digits-ddp", "--limit", "1", uri=uri)
    assert [_cells(row)[-1] for row in _rows(only.output)] == ["digits-c"]


def test_runs_of_an_unknown_or_empty_experiment_is_one_line(store):
    uri, _, _ = store
    result = _raylane("runs", "-e", "digits", uri=uri)
    assert result.exit_code == 2
    assert result.output == (
        f"error: no experiment 'digits' in {uri} (experiments: Default, digits-ddp, lm-serve)\n"
    )
    result = _raylane("runs", "-e", "Default", uri=uri)
    assert (result.exit_code, result.output) == (1, f"error: no runs in experiment 'Default' "
                                                    f"of {uri}\n")  # fmt: skip


def test_a_missing_store_is_one_line_and_is_not_created(tmp_path):
    for uri in (f"sqlite:///{tmp_path}/none.db", (tmp_path / "mlruns").as_uri()):
        for command in (["runs"], ["models"], ["logs", "0123456789ab"]):
            result = _raylane(*command, "--set", f"tracking.tracking_uri={uri}")
            assert result.exit_code == 2
            assert result.output.startswith(f"error: no MLflow tracking store at {uri} (")
            assert result.output.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_models_lists_models_then_one_models_versions(store):
    uri, runs, _ = store
    result = _raylane("models", uri=uri)
    assert result.exit_code == 0, result.output
    assert [_cells(row) for row in _rows(result.output)] == [
        ["raylane-digits", "2", "v2", "champion: v1", runs["digits-b"][:12]],
        ["raylane-lm", "1", "v1", "champion: v1", runs["lm-a"][:12]],
    ]
    versions = [_cells(row) for row in _rows(_raylane("models", "raylane-digits", uri=uri).output)]
    assert [(row[0], row[1], row[-1]) for row in versions] == [
        ("v2", "-", runs["digits-b"][:12]),
        ("v1", "champion", runs["digits-a"][:12]),
    ]
    result = _raylane("models", "raylane-digit", uri=uri)
    assert result.exit_code == 2
    assert result.output == (
        f"error: no registered model 'raylane-digit' in {uri} (did you mean raylane-digits?)\n"
    )


def test_logs_prints_a_runs_console_logs_found_by_a_prefix(store, tmp_path):
    uri, runs, _ = store
    config = tmp_path / "store.yaml"
    config.write_text(f"experiment: x\ntracking:\n  tracking_uri: {uri}\n")
    run = runs["digits-b"]
    result = _raylane("logs", run[:8], "--config", str(config))
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "==> logs/rank-0.out <==\ndigits-b rank 0 epoch 1\n"
        "==> logs/rank-1.err <==\ndigits-b rank 1 warning\n"
    )
    assert _raylane("logs", run, "--rank", "1", uri=uri).stdout.splitlines()[-1] == (
        "digits-b rank 1 warning"
    )
    shown = _raylane("logs", run[:12], "--artifact", "config/resolved.yaml", uri=uri)
    assert shown.stdout == "experiment: digits-b\n"


def test_logs_of_an_unknown_run_or_a_run_without_logs_is_one_line(store):
    uri, runs, _ = store
    for run, line, code in [
        ("0" * 32, f"run {'0' * 32}: no such run in {uri}", 2),
        ("00000000", f"run 00000000: no run id starts so in {uri}", 2),
        ("abc", "run 'abc': expected a run id, or its first 6 or more characters", 2),
        (runs["lm-a"], f"run {runs['lm-a'][:12]} logged no console logs (text artifacts: "
                       "config/resolved.yaml)", 1),
    ]:  # fmt: skip
        result = _raylane("logs", run, uri=uri)
        assert (result.exit_code, result.output) == (code, f"error: {line}\n")


def test_compare_and_reproduce_take_a_prefix(store):
    uri, runs, _ = store
    a, b = runs["digits-a"], runs["digits-b"]
    result = _raylane("compare", a[:7], b[:9], "--tracking-uri", uri)
    assert result.exit_code == 0, result.output
    assert a[:12] in result.output and b[:12] in result.output and "val_loss" in result.output
    result = _raylane("reproduce", "fffffff", "--tracking-uri", uri)  # refused before Ray
    assert result.output == f"error: run fffffff: no run id starts so in {uri}\n"


def test_promote_takes_model_and_version_and_still_version_alone(store, monkeypatch):
    monkeypatch.chdir(ROOT)  # the default config is relative to the repository
    uri, _, client = store
    sets = ["--set", f"tracking.tracking_uri={uri}"]
    result = _raylane("promote", "raylane-lm", "1", *sets)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "raylane-lm@champion -> v1"
    result = _raylane("promote", "2", *sets)  # the config's model: raylane-digits
    assert result.output.splitlines()[0] == "raylane-digits@champion -> v2"
    assert int(client.get_model_version_by_alias("raylane-digits", "champion").version) == 2
    result = _raylane("promote", "1", *sets)
    assert int(client.get_model_version_by_alias("raylane-digits", "champion").version) == 1
    for args, line in [
        (["raylane-lm", "3"], f"registered model 'raylane-lm' has no version 3 in {uri}"),
        (["raylane-lm", "v1"], "VERSION must be a registry version (1, 2, ...), not 'v1'"),
        ([], "promote needs VERSION, or MODEL VERSION (e.g. raylane promote 3)"),
    ]:
        result = _raylane("promote", *args, *sets)
        assert (result.exit_code, result.output) == (2, f"error: {line}\n")
