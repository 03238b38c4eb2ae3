"""Rank 0's journal and the driver's recorder: every record reaches the MLflow run once, in
order, with the time rank 0 measured it; a half-written line waits for the next read."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from raylane.tracking.runs import OUTAGE, TrackingOutageError
from raylane.train.journal import Journal, read_records
from raylane.train.recorder import RunRecorder

PLACEMENT = [
    {"rank": r, "node_id": f"n{r}", "node": f"10.0.0.{r}", "code_digest": "abc", "code_path": "/c"}
    for r in (0, 1)
]


def _run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, client, client.create_run(client.create_experiment("journal")).info.run_id


def test_a_line_still_being_written_waits_for_the_next_read(tmp_path):
    path = tmp_path / "journal.jsonl"
    Journal(path).log({"base_val_loss": 2.5}, step=0)
    with path.open("a") as out:
        out.write('{"kind": "metrics", "metr')  # rank 0 is mid-write
    records, offset = read_records(path, 0)
    assert [r["metrics"] for r in records] == [{"base_val_loss": 2.5}]
    assert read_records(path, offset) == ([], offset)
    with path.open("a") as out:
        out.write('ics": {"x": 1.0}, "step": 1, "time": 5.0}\n')
    records, _ = read_records(path, offset)
    assert records == [{"kind": "metrics", "metrics": {"x": 1.0}, "step": 1, "time": 5.0}]
    assert read_records(tmp_path / "none.jsonl", 0) == ([], 0)


def test_the_recorder_logs_each_record_into_the_run_once(tmp_path):
    uri, client, run_id = _run(tmp_path)
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.log_group(PLACEMENT, "torch==2.13.0\n")
    journal.log({"base_val_loss": 3.0}, step=0)
    epoch0 = {"val_loss": 2.0, "train_loss": 2.2, "epoch": 0, "step_ms": 4.0}
    journal.log_epoch(epoch0, 0, False, {"t": {"a": 1}})
    # A group restarted inside epoch 0 ends it again: the first record is kept.
    journal.log_epoch({"val_loss": 9.0, "train_loss": 9.0, "epoch": 0}, 0, True, {})
    journal.log_epoch(
        {"val_loss": 1.5, "train_loss": 1.7, "epoch": 1, "step_ms": 3.0}, 1, False, {}
    )
    lines: list[str] = []
    recorder = RunRecorder(path, uri, run_id, 2, 60.0, 0.0, emit=lines.append)
    with recorder:
        pass
    recorder.draw()
    recorder.close()

    val = client.get_metric_history(run_id, "val_loss")
    assert [(m.step, m.value) for m in val] == [(0, 2.0), (1, 1.5)]
    stamps = [json.loads(line)["time"] for line in path.read_text().splitlines()]
    assert [m.timestamp for m in val] == [int(stamps[2] * 1000), int(stamps[4] * 1000)]
    assert [m.value for m in client.get_metric_history(run_id, "base_val_loss")] == [3.0]
    assert [line.split("  ")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    run = client.get_run(run_id)
    assert run.data.tags["raylane.code_digest"] == "abc"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"t.json", "step_time_split.png", "parallel", "environment"} <= artifacts
    placement = Path(client.download_artifacts(run_id, "parallel/placement.json"))
    assert json.loads(placement.read_text()) == {"ranks": PLACEMENT}


def test_a_resumed_driver_logs_only_what_its_predecessor_had_not(tmp_path):
    uri, client, run_id = _run(tmp_path)
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    progress = {"epoch": 0, "step": 4, "steps": 8, "samples_per_s": 10.0,
                "data_wait_share": 0.0, "step_s": 1.0}  # fmt: skip
    journal.log_progress(progress)
    journal.log_epoch({"val_loss": 2.0}, 0, False, {})
    shown: list[str] = []
    first = RunRecorder(path, uri, run_id, 3, 60.0, 0.0, emit=shown.append)
    journal.log_progress({**progress, "epoch": 1})
    first.poll()  # the first driver logged epoch 0, then was killed
    inside = [line.split("  ")[1] for line in shown if line.startswith("  ")]
    assert inside == ["epoch 1, step 4/8", "epoch 2, step 4/8"]
    journal.log_epoch({"val_loss": 1.8}, 1, False, {})  # ended while no driver ran
    lines: list[str] = []
    resumed = RunRecorder(path, uri, run_id, 3, 60.0, 0.0, resumed=True, emit=lines.append)
    resumed.poll()  # the earlier driver's progress lines are not shown again
    journal.log_progress({**progress, "epoch": 2})
    journal.log_epoch({"val_loss": 1.6}, 2, False, {})
    resumed.__exit__()  # the fit ended: what the journal holds now
    resumed.close()
    history = client.get_metric_history(run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 1.8), (2, 1.6)]
    assert [line.split("  ")[0] for line in lines] == ["epoch 2/3", "", "epoch 3/3"]
    assert lines[1].startswith("  epoch 3, step 4/8  10 samples/s")


def test_an_outage_past_its_window_is_the_recorders_error_off_the_main_thread(tmp_path):
    path = tmp_path / "journal.jsonl"
    Journal(path).log_epoch({"val_loss": 2.0}, 0, False, {})
    gone = f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}"  # a store that cannot answer
    recorder = RunRecorder(path, gone, "run", 1, 0.0, 0.0, emit=print, interval_s=0.05)

    def fit() -> None:  # a library caller's thread: no SIGINT is sent
        with recorder:
            time.sleep(1.0)

    caller = threading.Thread(target=fit)
    caller.start()
    caller.join()
    assert isinstance(recorder.error, TrackingOutageError), recorder.error
    assert OUTAGE in str(recorder.error)


def test_a_figure_in_flight_is_never_interrupted_by_a_later_epoch(tmp_path, monkeypatch):
    """A Ray task interrupted inside matplotlib's import leaves its worker unable to import it
    again: a later epoch's figure waits for the one in flight instead of cancelling it."""
    from raylane.train import recorder as module

    uri, _, run_id = _run(tmp_path)
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    started: list[list[dict]] = []
    finished: set[int] = set()

    class Task:
        def remote(self, history):
            started.append(history)
            return len(started)

    def cancel(*_, **__):
        raise AssertionError("a drawing task was cancelled")

    monkeypatch.setattr(module, "_draw_remote", Task())
    monkeypatch.setattr(module.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(module.ray, "cancel", cancel)
    monkeypatch.setattr(
        module.ray, "wait", lambda refs, timeout: ([r for r in refs if r in finished], [])
    )
    monkeypatch.setattr(module.ray, "get", lambda ref: b"png")
    recorder = RunRecorder(path, uri, run_id, 3, 60.0, 0.0, emit=lambda line: None)
    for epoch in range(2):
        journal.log_epoch(
            {"val_loss": 1.0, "train_loss": 1.0, "epoch": epoch, "step_ms": 1.0}, epoch, False, {}
        )
        recorder.poll()
    assert [len(h) for h in started] == [1]  # epoch 1's figure waits for epoch 0's task
    finished.add(1)
    recorder.poll()
    assert [len(h) for h in started] == [1, 2]
    finished.add(2)
    recorder.draw()
    assert [len(h) for h in started] == [1, 2]
    recorder.close()
