"""Per-node resource samples in the run's System metrics, from inside the worker group.

The driver may run on a machine that trains nothing; what a user wants to see is where the
workers spent CPU, memory, network (and GPU). One worker per node (its first rank) runs MLflow's
own `SystemMetricsMonitor` into the run, keyed by node (`system/<node>/cpu_utilization_percentage`),
so a multi-node run shows each node side by side in the MLflow UI's System metrics tab.
"""

from __future__ import annotations

from typing import Any


def node_label() -> str:
    """The node's name in metric keys: its IP and the start of its Ray node id (several nodes
    of a test or laptop cluster share one IP)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return f"{ray.util.get_node_ip_address()}-{node_id[:6]}"


def node_monitor(
    tracking_uri: str, run_id: str, interval_s: float, node: str, resume: bool = True
) -> Any:
    """MLflow's system metrics monitor for `node` in the run (not started)."""
    return _monitor_class()(
        run_id,
        sampling_interval=interval_s,
        samples_before_logging=1,
        # A restarted worker group continues the same run: its samples follow the earlier ones.
        resume_logging=resume,
        node_id=node,
        tracking_uri=tracking_uri,
    )


def start_node_monitor(
    tracking_uri: str, run_id: str, interval_s: float, first_on_node: bool
) -> Any | None:
    """Start sampling this node into the run (its first rank only); None when off or not ours."""
    if interval_s <= 0 or not first_on_node:
        return None
    monitor = node_monitor(tracking_uri, run_id, interval_s, node_label())
    monitor.start()
    return monitor


def torch_gpu_monitor(monitors: list) -> Any | None:
    """A monitor of the GPUs this process sees, read through torch, where MLflow's own GPU
    monitor could not start (it needs NVML's Python bindings and gives up without them); None
    where MLflow has one, where CUDA is not available (a CPU-only node: nothing is probed), or
    where torch can read neither utilisation nor memory (`torch.cuda.utilization` needs the
    same bindings; its free memory does not)."""
    import torch
    from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor

    if any(type(m).__name__ in ("GPUMonitor", "ROCMMonitor") for m in monitors):
        return None
    if not torch.cuda.is_available():
        return None

    class TorchGPUMonitor(BaseMetricsMonitor):
        """`gpu_<i>_utilization_percentage` and `gpu_<i>_memory_usage_megabytes` (MLflow's
        names) for each visible GPU, each skipped for good once it cannot be read."""

        readers = {
            "utilization_percentage": torch.cuda.utilization,
            # NVML's figure, as nvidia-smi shows it: `mem_get_info` would open a CUDA context
            # (hundreds of MB) on every GPU of the node, each another worker's.
            "memory_usage_megabytes": lambda i: torch.cuda.device_memory_used(i) / 1e6,
        }

        def __init__(self):
            super().__init__()
            self.devices = range(torch.cuda.device_count())
            self.working = {name for name in self.readers if self._read(name, 0) is not None}

        def _read(self, name: str, device: int) -> float | None:
            try:
                return float(self.readers[name](device))
            except Exception:  # noqa: BLE001 - no NVML bindings, a lost device: not sampled
                return None

        def collect_metrics(self) -> None:
            for device in self.devices:
                for name in self.working:
                    value = self._read(name, device)
                    if value is not None:
                        self._metrics[f"gpu_{device}_{name}"].append(value)

        def aggregate_metrics(self) -> dict[str, float]:
            return {k: round(sum(v) / len(v), 1) for k, v in self._metrics.items() if v}

    monitor = TorchGPUMonitor()
    return monitor if monitor.working else None


def _monitor_class() -> type:
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class NodeMonitor(SystemMetricsMonitor):
        """MLflow's monitor, which also keeps a last sample when it stops, and samples the
        node's GPUs through torch where MLflow's own GPU monitor could not start.

        MLflow's loop publishes only after a full sampling interval, so a worker whose training
        ends sooner (a short job, a fast epoch) would leave its node out of the run.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            gpus = torch_gpu_monitor(self.monitors)
            if gpus is not None:
                self.monitors.append(gpus)

        def finish(self) -> None:
            super().finish()
            self.collect_metrics()
            self.publish_metrics(self.aggregate_metrics())
            self.mlflow_logger.flush()

    return NodeMonitor
