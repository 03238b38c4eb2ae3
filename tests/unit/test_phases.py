import pytest

from raylane.train.phases import (
    MARK_PREFIX,
    PHASES,
    PhaseClock,
    WorkerMarks,
    marks_from_metrics,
)


def test_the_fit_is_split_at_rank_zeros_marks():
    clock = PhaseClock()
    marks = {"loop_start": 13.0, "data_start": 15.5, "first_batch": 18.0, "first_step": 18.25,
             "last_report": 21.0}  # fmt: skip
    clock.split_fit(10.0, 22.5, marks)
    assert clock.seconds == {
        "worker_group": 3.0,
        "worker_setup": 2.5,
        "dataset": 2.5,
        "first_step": 0.25,
        "training": 2.75,
        "fit_end": 1.5,
    }
    assert sum(clock.seconds.values()) == pytest.approx(22.5 - 10.0)


def test_a_missing_mark_folds_its_span_into_the_next_phase():
    clock = PhaseClock()
    # A resumed run past its last epoch: no batch, no step.
    clock.split_fit(0.0, 5.0, {"loop_start": 2.0, "last_report": 4.0})
    assert clock.seconds["worker_group"] == 2.0
    assert clock.seconds["dataset"] == clock.seconds["first_step"] == 0.0
    assert clock.seconds["training"] == 2.0 and clock.seconds["fit_end"] == 1.0


def test_metrics_and_the_console_line_keep_the_jobs_order():
    clock = PhaseClock()
    clock.add("model", 1.26)
    clock.add("ray", 4.0)
    clock.add("ray", 0.5)
    assert list(clock.metrics()) == ["phase_ray_s", "phase_model_s"]
    assert clock.metrics()["phase_ray_s"] == 4.5
    assert clock.line(total_s=9.0) == "phases (s): ray 4.5 · model 1.3 · total 9.0"
    with pytest.raises(ValueError, match="unknown phase 'warmup'"), clock.phase("warmup"):
        pass


def test_worker_marks_travel_in_report_metrics_and_come_back():
    marks = WorkerMarks()
    marks.mark("first_batch")
    first = marks.marks["first_batch"]
    marks.mark("first_batch")  # the first time wins
    sent = {"epoch": 0, **marks.report_metrics()}
    assert all(k.startswith(MARK_PREFIX) for k in sent if k != "epoch")
    back = marks_from_metrics(sent)
    assert back["first_batch"] == first
    assert back["loop_start"] <= first <= back["last_report"]
    assert set(PHASES) >= {"worker_group", "dataset", "shutdown"}
