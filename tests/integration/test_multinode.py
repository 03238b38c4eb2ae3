"""Training across the session cluster's two nodes, and targeting a node type by resource."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.train.job import run_training

from .conftest import REFERENCE, SECOND_NODE_RESOURCE


def _run(workspace, *overrides: str):
    cfg = load_config(
        REFERENCE,
        workspace.overrides(
            "training.epochs=1",
            "tracking.registered_model=raylane-digits-multinode",
            "tracking.system_metrics_interval_s=1",
            *overrides,
        ),
    )
    outcome = run_training(cfg, register=False)  # nobody here reads the model
    client = MlflowClient(tracking_uri=workspace.tracking_uri)

    def artifact(path: str) -> dict:
        return json.loads(Path(client.download_artifacts(outcome.run_id, path)).read_text())

    placement = artifact("parallel/placement.json")["ranks"]
    metrics = client.get_run(outcome.run_id).data.metrics
    for rank in placement:  # each node that ran workers sampled itself into the run
        for name in ("cpu_utilization_percentage", "system_memory_usage_megabytes"):
            assert f"system/{rank['node']}/{name}" in metrics, sorted(metrics)
    return placement, artifact("cluster/snapshot.json")


def test_ddp_workers_spread_over_both_nodes_and_the_run_records_them(second_node, workspace):
    placement, snapshot = _run(workspace, "parallelism.placement_strategy=STRICT_SPREAD")
    worker_nodes = {rank["node_id"] for rank in placement}
    assert len(placement) == 2 and len(worker_nodes) == 2
    assert len({rank["node"] for rank in placement}) == 2  # two nodes in System metrics
    assert worker_nodes == {node["node_id"] for node in snapshot["nodes"]}
    assert second_node in worker_nodes


def test_workers_target_a_node_type_by_custom_resource(second_node, workspace):
    placement, _ = _run(
        workspace,
        f"parallelism.resources_per_worker={{CPU: 0.5, {SECOND_NODE_RESOURCE}: 1}}",
    )
    assert [rank["node_id"] for rank in placement] == [second_node, second_node]
