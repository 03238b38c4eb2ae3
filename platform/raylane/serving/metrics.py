"""Replica metrics that Ray Serve does not export itself.

Serve already exports request counts and latency by route and status
(`ray_serve_num_http_requests_total`, `ray_serve_http_request_latency_ms`,
`ray_serve_num_http_error_requests_total`), queue depth (`ray_serve_deployment_queued_queries`,
`ray_serve_batch_queue_length`) and requests per batch (`ray_serve_actual_batch_size`).
Missing for a model server: which registry version each replica serves, how long the forward
itself takes (without queueing and HTTP), and how many rows a batch carried (a request may hold
many rows). All reach Prometheus through Ray's metrics endpoint on every node.
"""

from __future__ import annotations

from ray.serve.metrics import Gauge, Histogram

FORWARD_MS_BUCKETS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
ROW_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]


class ReplicaMetrics:
    def __init__(self, model_name: str, version: int):
        # Serve adds its own tags into the dict it is given: one dict per metric.
        self.version = Gauge(
            "raylane_served_model_version",
            description="Registry version this replica serves.",
            tag_keys=("model",),
        )
        self.version.set_default_tags({"model": model_name})
        self._version = version
        self.version.set(version)
        self.forward_ms = Histogram(
            "raylane_forward_latency_ms",
            description="Time of one batched model forward (milliseconds).",
            boundaries=FORWARD_MS_BUCKETS,
            tag_keys=("model",),
        )
        self.forward_ms.set_default_tags({"model": model_name})
        self.rows = Histogram(
            "raylane_batch_rows",
            description="Rows (samples) carried by one batched forward.",
            boundaries=ROW_BUCKETS,
            tag_keys=("model",),
        )
        self.rows.set_default_tags({"model": model_name})

    def record_forward(self, rows: int, seconds: float) -> None:
        self.forward_ms.observe(seconds * 1000.0)
        self.rows.observe(rows)
        # Set again with every batch: a gauge set only once, at start-up, was not exported
        # under Serve's throughput-optimized mode.
        self.version.set(self._version)
