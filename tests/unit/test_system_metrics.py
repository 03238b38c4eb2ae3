"""A node's system metrics reach the run even when its worker stops within one interval."""

import mlflow
from mlflow.tracking import MlflowClient

from raylane.tracking.system_metrics import node_monitor


def test_a_monitor_stopped_before_its_first_interval_still_records_the_node(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("monitor"))
    monitor = node_monitor(uri, run.info.run_id, interval_s=30, node="node-a", resume=False)
    monitor.start()
    monitor.finish()  # long before the 30 s interval
    metrics = client.get_run(run.info.run_id).data.metrics
    assert "system/node-a/cpu_utilization_percentage" in metrics, sorted(metrics)
    assert metrics["system/node-a/system_memory_usage_megabytes"] > 0
    assert mlflow.active_run() is None
