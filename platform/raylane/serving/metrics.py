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


class _ModelMetrics:
    """Metrics tagged with the model a replica serves, its registry version among them."""

    def __init__(self, model_name: str, version: int):
        self.model_name, self._version = model_name, version
        self.version = self._metric(
            Gauge, "raylane_served_model_version", "Registry version this replica serves."
        )
        self.version.set(version)

    def _metric(self, kind, name: str, description: str, **options):
        metric = kind(name, description=description, tag_keys=("model",), **options)
        # Serve adds its own tags into the dict it is given: one dict per metric.
        metric.set_default_tags({"model": self.model_name})
        return metric

    def _keep_version(self) -> None:
        # Set again with every batch or step: a gauge set only once, at start-up, was not
        # exported under Serve's throughput-optimized mode.
        self.version.set(self._version)


class ReplicaMetrics(_ModelMetrics):
    def __init__(self, model_name: str, version: int):
        super().__init__(model_name, version)
        self.forward_ms = self._metric(
            Histogram, "raylane_forward_latency_ms",
            "Time of one batched model forward (milliseconds).", boundaries=FORWARD_MS_BUCKETS,
        )  # fmt: skip
        self.rows = self._metric(
            Histogram, "raylane_batch_rows", "Rows (samples) carried by one batched forward.",
            boundaries=ROW_BUCKETS,
        )  # fmt: skip

    def record_forward(self, rows: int, seconds: float) -> None:
        self.forward_ms.observe(seconds * 1000.0)
        self.rows.observe(rows)
        self._keep_version()


TTFT_MS_BUCKETS = [5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
STEP_MS_BUCKETS = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500]


class GenerationMetrics(_ModelMetrics):
    """Time to first token, time per decode step (each running sequence's inter-token
    latency), tokens generated, and the scheduler's running / waiting sequences and cache
    slots in use."""

    def __init__(self, model_name: str, version: int):
        from ray.serve.metrics import Counter

        super().__init__(model_name, version)
        self.ttft_ms = self._metric(
            Histogram, "raylane_time_to_first_token_ms",
            "From request to its first generated token (milliseconds).",
            boundaries=TTFT_MS_BUCKETS,
        )  # fmt: skip
        self.step_ms = self._metric(
            Histogram, "raylane_inter_token_latency_ms",
            "One scheduler step: the time between a running sequence's tokens (milliseconds).",
            boundaries=STEP_MS_BUCKETS,
        )  # fmt: skip
        self.running = self._metric(Gauge, "raylane_running_sequences", "Sequences decoding.")
        self.waiting = self._metric(
            Gauge, "raylane_waiting_sequences", "Requests waiting for a cache slot."
        )
        self.slots = self._metric(
            Gauge, "raylane_cache_slots_in_use", "KV-cache slots held by sequences."
        )
        self.acceptance = self._metric(
            Gauge, "raylane_speculative_acceptance_rate",
            "Proposed tokens accepted (speculative decoding), since the replica started.",
        )  # fmt: skip
        self.tokens = self._metric(Counter, "raylane_generated_tokens_total", "Tokens generated.")

    def record_step(self, engine, tokens: int, seconds: float) -> None:
        self.step_ms.observe(seconds * 1000.0)
        if tokens:
            self.tokens.inc(tokens)
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        self.slots.set(engine.cache.slots - len(engine.free))
        if engine.acceptance_rate is not None:
            self.acceptance.set(engine.acceptance_rate)
        self._keep_version()

    def record_first_token(self, seconds: float) -> None:
        self.ttft_ms.observe(seconds * 1000.0)
