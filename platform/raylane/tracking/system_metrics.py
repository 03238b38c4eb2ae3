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


def _monitor_class() -> type:
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class NodeMonitor(SystemMetricsMonitor):
        """MLflow's monitor, which also keeps a last sample when it stops.

        MLflow's loop publishes only after a full sampling interval, so a worker whose training
        ends sooner (a short job, a fast epoch) would leave its node out of the run.
        """

        def finish(self) -> None:
            super().finish()
            self.collect_metrics()
            self.publish_metrics(self.aggregate_metrics())
            self.mlflow_logger.flush()

    return NodeMonitor
