"""A GPU run is held to its device's memory, not the host's: Tune's budget reads the workers'
peak GPU memory, the profile's model predicts device memory on GPU runs, and the system
metrics sample the GPUs through torch where MLflow's own GPU monitor could not start."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from raylane.plan.measured import predict_config
from raylane.tracking.system_metrics import torch_gpu_monitor
from raylane.tune.candidates import enumerate_candidates
from raylane.tune.search import TrialOutcome, _judge

from .test_plan_measured import PROFILE, _ddp, _spec


def _judged(**columns) -> TrialOutcome:
    """A trial that ran every epoch, its loss falling, with these per-epoch columns (the
    first value repeated for the epochs before the listed ones)."""
    spec = _spec(budget_mb=1_000, top_k=1)
    epochs = spec.trial.epochs
    columns = {key: [v[0]] * (epochs - len(v)) + v for key, v in columns.items()}
    frame = pd.DataFrame(
        {
            "train_samples_per_s": [10.0] * epochs,
            "train_loss": [2.0 - 0.1 * epoch for epoch in range(epochs)],
            **columns,
        }
    )
    result = SimpleNamespace(error=None, metrics_dataframe=frame)
    return _judge(spec, enumerate_candidates(spec)[0][0], result)


def test_a_cpu_trial_is_held_to_its_resident_memory():
    outcome = _judged(peak_rss_mb=[900.0, 1_200.0])
    assert outcome.peak_device_mb is None and outcome.peak_memory_mb == 1_200.0
    assert (outcome.status, outcome.detail) == (
        "rejected",
        "peak worker memory 1200 MB over the 1000 MB budget",
    )


def test_a_gpu_trial_is_held_to_its_device_memory_not_its_hosts():
    # 3 GB of host RSS (CUDA context, libraries) but 800 MB on the device: it fits.
    fits = _judged(peak_rss_mb=[3_000.0, 3_000.0], worker_device_peak_mb=[700.0, 800.0])
    assert fits.status == "ok" and fits.peak_memory_mb == 800.0
    over = _judged(peak_rss_mb=[500.0, 500.0], worker_device_peak_mb=[900.0, 1_100.0])
    assert (over.status, over.detail) == (
        "rejected",
        "peak device memory 1100 MB over the 1000 MB budget",
    )


def test_the_profiles_model_predicts_device_memory_on_a_gpu_run():
    cpu = predict_config(PROFILE, _ddp(1, 16))
    gpu = predict_config(PROFILE, _ddp(1, 16, "parallelism.use_gpu=true"))
    # The CPU run starts from the worker's 400 MB resident baseline; the GPU run from what the
    # device held before any model (none measured on CPUs: 0).
    assert cpu.memory_mb - gpu.memory_mb == pytest.approx(400.0)
    measured = {**PROFILE, "baseline_device_mb": 25.0}
    on_device = predict_config(measured, _ddp(1, 16, "parallelism.use_gpu=true"))
    assert on_device.memory_mb - gpu.memory_mb == pytest.approx(25.0)


def test_a_cpu_only_node_samples_no_gpu(monkeypatch):
    def never(*args):
        raise AssertionError("a CPU-only node must not probe a GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "utilization", never)
    assert torch_gpu_monitor([]) is None


def test_gpus_are_sampled_through_torch_and_an_unreadable_figure_is_skipped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "utilization", lambda i: 40 + 10 * i)

    def no_memory(i):
        raise RuntimeError("lost device")

    monkeypatch.setattr(torch.cuda, "device_memory_used", no_memory)
    monitor = torch_gpu_monitor([])
    monitor.collect_metrics()
    monitor.collect_metrics()
    assert monitor.aggregate_metrics() == {
        "gpu_0_utilization_percentage": 40.0,
        "gpu_1_utilization_percentage": 50.0,
    }


def test_gpu_memory_is_read_through_nvml_without_a_context_on_other_workers_gpus(monkeypatch):
    """`mem_get_info` opens a CUDA context on the device it asks about: the node's monitor must
    not (every other worker's GPU would lose hundreds of MB to it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "utilization", lambda i: 40 + 10 * i)
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda i: (i + 1) * 2_000_000)

    def opens_a_context(i):
        raise AssertionError(f"a CUDA context opened on GPU {i}")

    monkeypatch.setattr(torch.cuda, "mem_get_info", opens_a_context)
    monitor = torch_gpu_monitor([])
    monitor.collect_metrics()
    found = monitor.aggregate_metrics()
    assert found["gpu_0_memory_usage_megabytes"] == 2.0
    assert found["gpu_1_memory_usage_megabytes"] == 4.0


def test_no_gpu_figure_readable_means_no_gpu_monitor(monkeypatch):
    def unreadable(i):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "utilization", unreadable)
    monkeypatch.setattr(torch.cuda, "device_memory_used", unreadable)
    assert torch_gpu_monitor([]) is None


def test_mlflows_own_gpu_monitor_is_not_doubled(monkeypatch):
    class GPUMonitor:  # MLflow's, as NodeMonitor finds it among its monitors
        pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch_gpu_monitor([GPUMonitor()]) is None
