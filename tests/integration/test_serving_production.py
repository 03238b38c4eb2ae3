"""Production serving under real load on 127.0.0.1: API key, body limit, fuzzing, backpressure,
autoscaling, a killed replica, zero-downtime upgrade and rollback, metrics and access logs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from raylane.config import load_config
from raylane.serving.loadgen import BackgroundLoad, run_load

from .conftest import REFERENCE, free_port

MODEL = "digits"
REGISTERED = "raylane-digits-prod"
KEY_ENV = "RAYLANE_TEST_API_KEY"
API_KEY = uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {API_KEY}"}
INFER = f"/v2/models/{MODEL}/infer"
ROW = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": [3.0] * 64}]}
SETTLE_S = 90.0


@pytest.fixture(scope="module")
def versions(trained, workspace):
    """Two registry versions under a name of this module's own, holding different weights: the
    trained model (v1) and a differently initialised one of the same architecture (v2), so a
    test can tell from the answers which weights serve."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.tracking import MlflowClient

    from raylane.models import build_model
    from raylane.tracking.runs import log_trained_model

    cfg, outcome = trained
    client = MlflowClient(tracking_uri=workspace.tracking_uri)
    source = client.get_model_version(cfg.tracking.registered_model, str(outcome.model_version))
    client.create_registered_model(REGISTERED)
    first = client.create_model_version(
        REGISTERED, source.source, run_id=source.run_id, model_id=source.model_id
    )
    torch.manual_seed(12345)
    other = build_model(cfg.model)
    tracking = cfg.tracking.model_copy(update={"registered_model": REGISTERED})
    mlflow.set_tracking_uri(workspace.tracking_uri)
    mlflow.set_experiment("serving-production-versions")
    with mlflow.start_run():
        example = np.asarray([ROW["inputs"][0]["data"]], dtype=np.float32)
        log_trained_model(other, cfg.model_copy(update={"tracking": tracking}), example)
    registered = client.search_model_versions(f"name = '{REGISTERED}'")
    made = sorted(int(v.version) for v in registered)
    assert made == [int(first.version), int(first.version) + 1]
    client.set_registered_model_alias(REGISTERED, "champion", str(made[0]))
    return made


@pytest.fixture(scope="module")
def overrides(workspace):
    return workspace.overrides(
        f"tracking.registered_model={REGISTERED}",
        f"serving.port={free_port()}",
        f"serving.api_key_env={KEY_ENV}",
        "serving.max_batch_size=8",
        "serving.max_ongoing_requests=8",
        "serving.max_queued_requests=16",
        "serving.retry_after_s=2",
        "serving.max_body_bytes=65536",
        "serving.replica_cpus=0.5",
        "serving.autoscaling.min_replicas=1",
        "serving.autoscaling.max_replicas=2",
        "serving.autoscaling.target_ongoing_requests=2",
        "serving.autoscaling.upscale_delay_s=1",
        "serving.autoscaling.downscale_delay_s=4",
    )


@pytest.fixture(scope="module")
def endpoint(versions, overrides):
    from raylane.serving.app import deploy, shutdown_serve

    os.environ[KEY_ENV] = API_KEY
    try:
        url, served = deploy(load_config(REFERENCE, overrides))
        assert served == versions[0]
        yield url
    finally:
        shutdown_serve()
        os.environ.pop(KEY_ENV, None)


def _cli(ray_cluster, *args: str) -> subprocess.CompletedProcess:
    env = {
        **ray_cluster.client_env,
        "RAY_ADDRESS": ray_cluster.address,
        KEY_ENV: API_KEY,
        "COLUMNS": "200",
    }
    return subprocess.run(
        [sys.executable, "-m", "raylane.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _set_args(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _running_replicas() -> int:
    from ray import serve

    from raylane.serving.app import APP_NAME
    from raylane.serving.status import state_name

    states = serve.status().applications[APP_NAME].deployments["model"].replica_states
    return sum(count for state, count in states.items() if state_name(state) == "RUNNING")


def _wait_for(predicate, what: str, timeout_s: float = SETTLE_S) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - started


def _served_version(url: str) -> int:
    return int(httpx.get(f"{url}/v2/models/{MODEL}", headers=AUTH).json()["versions"][0])


def _logits(url: str) -> list[float]:
    """The served model's logits for ROW (retrying a request the loaded endpoint sheds)."""
    for _ in range(50):
        answer = httpx.post(f"{url}{INFER}", json=ROW, headers=AUTH)
        if answer.status_code == 200:
            return next(o["data"] for o in answer.json()["outputs"] if o["name"] == "logits")
        time.sleep(0.2)
    raise AssertionError(f"no 200 in 50 tries: {answer.status_code} {answer.text[:200]}")


def test_inference_needs_the_api_key_but_health_does_not(endpoint):
    assert httpx.post(f"{endpoint}{INFER}", json=ROW).status_code == 401
    wrong = httpx.post(f"{endpoint}{INFER}", json=ROW, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]
    assert httpx.get(f"{endpoint}/v2/models/{MODEL}").status_code == 401
    assert httpx.post(f"{endpoint}{INFER}", json=ROW, headers=AUTH).status_code == 200
    assert httpx.get(f"{endpoint}/v2/health/ready").status_code == 200
    assert httpx.get(f"{endpoint}/v2/health/live").status_code == 200


def test_oversized_bodies_get_413_declared_or_streamed(endpoint):
    big = {"inputs": [{**ROW["inputs"][0], "data": [1.0] * 20_000}]}
    declared = httpx.post(f"{endpoint}{INFER}", json=big, headers=AUTH)
    assert declared.status_code == 413 and "65536-byte limit" in declared.json()["error"]
    payload = json.dumps(big).encode()
    chunks = (payload[i : i + 8192] for i in range(0, len(payload), 8192))  # no Content-Length
    streamed = httpx.post(
        f"{endpoint}{INFER}", content=chunks, headers={**AUTH, "content-type": "application/json"}
    )
    assert streamed.status_code == 413
    assert httpx.post(f"{endpoint}{INFER}", json=ROW, headers=AUTH).status_code == 200


def test_fuzzed_requests_never_get_a_5xx(endpoint):
    """Every operation of the OpenAPI schema, fuzzed by schemathesis in both modes (requests
    that fit the schema and requests that break it), with the API key: no 5xx at all."""
    from hypothesis import given
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(f"{endpoint}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    calls: list[tuple[str, int]] = []
    server_errors: list[str] = []

    for operation in operations:
        # The served model's name, so requests get past the 404 into the body checks.
        fixed = {"name": MODEL} if "{name}" in operation.path else None
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=25,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode, path_parameters=fixed))
            def check(case):
                response = case.call(base_url=endpoint, headers=AUTH, timeout=30)
                calls.append((f"{case.method} {case.path}", response.status_code))
                if response.status_code >= 500:
                    server_errors.append(
                        f"{case.method} {case.formatted_path} -> {response.status_code}: "
                        f"{response.text[:200]}"
                    )

            # Unsatisfiable: nothing in the operation to break (e.g. a GET without parameters).
            with contextlib.suppress(Unsatisfiable):
                check()
    assert len(calls) >= 40
    assert sum(call.endswith("/infer") for call, _ in calls) >= 12
    assert not server_errors, server_errors[:5]
    assert any(400 <= status < 500 for _, status in calls)  # the fuzzing reached the checks


def test_over_limit_requests_get_a_fast_503_with_retry_after(endpoint):
    result = run_load(
        endpoint, INFER, ROW, clients=96, duration_s=4.0, max_requests=4_000, headers=AUTH
    )
    assert not result.failures, result.failures[:3]
    assert set(result.statuses) <= {200, 503}, result.statuses
    assert result.statuses[503] > 0 and result.statuses[200] > 0, result.statuses
    assert result.headers_by_status[503]["retry-after"] == "2"
    # At most (8 ongoing + 16 queued) per replica, 2 replicas at most, of the 96 clients are
    # let in at a time: the other 48 or more keep being refused. A refusal does not wait its
    # turn (each one sends its next request at once), so refusals outnumber answers; were
    # they queued as long as answers, they could not (at most 48 refused against 48 answered).
    assert result.statuses[503] > result.statuses[200], result.statuses
    assert httpx.post(f"{endpoint}{INFER}", json=ROW, headers=AUTH).status_code == 200
    assert httpx.get(f"{endpoint}/v2/health/ready").status_code == 200


def test_scales_up_under_load_replaces_a_killed_replica_and_scales_down(
    endpoint, ray_cluster, overrides
):
    import ray
    from ray.util.state import list_actors

    _wait_for(lambda: _running_replicas() == 1, "settling at one replica")
    with BackgroundLoad(
        endpoint, INFER, ROW, clients=16, duration_s=150, max_requests=200_000, headers=AUTH
    ) as load:
        _wait_for(lambda: _running_replicas() == 2, "scaling up to 2 replicas")

        replicas = list_actors(
            filters=[("class_name", "=", "ServeReplica:raylane:model"), ("state", "=", "ALIVE")]
        )
        assert len(replicas) == 2
        victim = replicas[0]
        ray.kill(ray.get_actor(victim.name, namespace="serve"), no_restart=True)
        killed_at = time.monotonic()

        def replaced() -> bool:
            alive = list_actors(
                filters=[
                    ("class_name", "=", "ServeReplica:raylane:model"),
                    ("state", "=", "ALIVE"),
                ]
            )
            ids = {a.actor_id for a in alive}
            return victim.actor_id not in ids and _running_replicas() == 2

        _wait_for(replaced, "replacing the killed replica")
        time.sleep(3)
    result = load.result
    # Whatever failed, failed from the kill on: everything before it was answered.
    before = [status for end, status, _ in result.events if end < killed_at]
    assert before and set(before) == {200}, result.statuses
    # And it recovered: requests sent after the last failed one ended were answered.
    failed_ends = [end for end, status, _ in result.events if status != 200]
    last_failure = max(failed_ends, default=killed_at)
    assert any(end - latency > last_failure for end, _, latency in result.events), last_failure
    # Only requests on the killed replica may fail: with the HAProxy ingress each replica holds
    # its own queue, so that is at most max_ongoing_requests + max_queued_requests (8 + 16).
    # They fail as a dropped connection or as HAProxy's own 500 for a request whose server
    # went away (Serve's HAProxy config answers 502/503/504 as 500); nothing else.
    failed = result.requests - result.statuses[200] + len(result.failures)
    assert failed <= 8 + 16, (result.statuses, result.failures[:3])
    assert set(result.statuses) <= {200, 500}, result.statuses

    _wait_for(lambda: _running_replicas() == 1, "scaling back down to 1 replica")
    status = _cli(ray_cluster, "status", "--config", str(REFERENCE), *_set_args(overrides))
    assert status.returncode == 0, status.stderr
    assert "1 running" in status.stdout and "v1" in status.stdout, status.stdout


def test_upgrade_and_rollback_under_load_fail_no_request(
    endpoint, versions, overrides, ray_cluster
):
    from raylane.serving.app import deploy

    old, new = versions
    assert _served_version(endpoint) == old
    old_logits = _logits(endpoint)
    with BackgroundLoad(
        endpoint, INFER, ROW, clients=8, duration_s=240, max_requests=200_000, headers=AUTH
    ) as load:
        time.sleep(2)
        promoted = _cli(
            ray_cluster, "promote", str(new), "--config", str(REFERENCE), *_set_args(overrides)
        )
        assert promoted.returncode == 0, promoted.stderr
        assert f"now serves v{new}" in promoted.stderr, promoted.stderr
        promoted_at = time.monotonic()
        assert _served_version(endpoint) == new
        new_logits = _logits(endpoint)  # the other weights answer, not only another label
        assert max(abs(a - b) for a, b in zip(new_logits, old_logits, strict=True)) > 1e-3
        time.sleep(2)
        _, served = deploy(load_config(REFERENCE, [*overrides, f"serving.model_version={old}"]))
        assert served == old
        rolled_back_at = time.monotonic()
        time.sleep(2)
    result = load.result
    assert not result.failures and set(result.statuses) == {200}, (
        result.statuses,
        result.failures[:3],
    )
    # Answered before the upgrade, between it and the rollback, and after the rollback.
    ends = [end for end, _, _ in result.events]
    assert min(ends) < promoted_at < rolled_back_at < max(ends)
    assert any(promoted_at < end < rolled_back_at for end in ends)
    assert _served_version(endpoint) == old
    assert _logits(endpoint) == pytest.approx(old_logits, abs=1e-5)


def test_prometheus_metrics_and_json_access_logs(endpoint, ray_cluster):
    import ray

    request_id = f"test-{uuid.uuid4().hex[:12]}"
    response = httpx.post(
        f"{endpoint}{INFER}", json=ROW, headers={**AUTH, "X-Request-ID": request_id}
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == request_id
    assert httpx.post(f"{endpoint}{INFER}", json=ROW).status_code == 401  # counted as an error

    wanted = [
        "ray_serve_num_http_requests_total",
        "ray_serve_http_request_latency_ms_bucket",
        "ray_serve_num_http_error_requests_total",
        "ray_serve_actual_batch_size_bucket",
        "ray_serve_deployment_queued_queries",
        "raylane_served_model_version",
        "raylane_forward_latency_ms_bucket",
        "raylane_batch_rows_bucket",
    ]

    missing = list(wanted)

    def exported() -> bool:
        text = httpx.get(ray_cluster.metrics_url, timeout=10).text
        missing[:] = [name for name in wanted if name not in text]
        # The error counter may already exist from another app's errors: wait for this 401.
        return not missing and ('error_code="401"' in text or 'status_code="401"' in text)

    with contextlib.suppress(TimeoutError):
        _wait_for(exported, "exporting the serving metrics", timeout_s=60)
    assert not missing, f"not exported within 60 s: {missing}"
    text = httpx.get(ray_cluster.metrics_url, timeout=10).text
    assert 'error_code="401"' in text or 'status_code="401"' in text

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    def logged() -> bool:
        for path in logs.glob("replica_raylane_model_*.log"):
            for line in path.read_text().splitlines():
                if request_id in line:
                    record = json.loads(line)
                    return record["request_id"] == request_id
        return False

    _wait_for(logged, "writing the access log line", timeout_s=30)


def test_the_raw_api_key_stays_out_of_ray(endpoint, ray_cluster):
    """Replicas receive only a digest of the key: the key itself is in no deployment argument
    or config the dashboard or State API shows, and in no log file of the cluster."""
    import ray

    from raylane.serving.app import APP_NAME

    assert httpx.post(f"{endpoint}{INFER}", json=ROW, headers=AUTH).status_code == 200
    token = ray_cluster.token_path.read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    for path in (
        "/api/serve/applications/",
        "/api/v0/actors?detail=1&limit=10000",
        "/api/v0/tasks?detail=1&limit=10000",
    ):
        answer = httpx.get(f"{ray_cluster.dashboard_url}{path}", headers=headers, timeout=60)
        assert answer.status_code == 200, (path, answer.text[:300])
        assert API_KEY not in answer.text, path
        # A real answer: the app, its replica actors, the cluster's tasks.
        payload = answer.json()
        if path.startswith("/api/serve"):
            assert APP_NAME in payload["applications"], list(payload["applications"])
            continue
        rows = payload["data"]["result"]["result"]
        assert rows, (path, payload["data"]["result"])
        if "actors" in path:
            names = {row.get("class_name", "") for row in rows}
            assert any(name.startswith("ServeReplica") for name in names), names
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [path for path in logs.rglob("*") if path.is_file()]
    assert len(files) > 10
    leaked = [str(path) for path in files if API_KEY.encode() in path.read_bytes()]
    assert not leaked, leaked
