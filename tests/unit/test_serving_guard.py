"""The request guard (API key, body limit) on a small FastAPI app, and where keys come from."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from raylane.config import ConfigError, load_config
from raylane.serving.guard import ApiKeyError, GuardSettings, RequestGuard, key_digest, load_api_key
from raylane.serving.loadgen import LoadResult, build_request

from .test_config import REFERENCE


def _client(key: str | None, limit: int = 2048) -> TestClient:
    app = FastAPI()
    app.add_middleware(RequestGuard, settings=GuardSettings(key_digest(key), limit))

    @app.post("/v2/models/m/infer")
    async def infer(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.get("/v2/health/ready")
    async def ready() -> dict:
        return {"ready": True}

    return TestClient(app)


def test_key_is_required_on_inference_but_not_on_health():
    client = _client("s3cret")
    assert client.post("/v2/models/m/infer", content=b"{}").status_code == 401
    wrong = client.post("/v2/models/m/infer", content=b"{}", headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    basic = client.post("/v2/models/m/infer", headers={"Authorization": "Basic s3cret"})
    assert basic.status_code == 401
    right = client.post(
        "/v2/models/m/infer", content=b"{}", headers={"Authorization": "Bearer s3cret"}
    )
    assert right.status_code == 200 and right.json() == {"bytes": 2}
    assert client.get("/v2/health/ready").status_code == 200


def test_no_key_configured_means_open():
    assert _client(None).post("/v2/models/m/infer", content=b"{}").status_code == 200


def test_body_limit_applies_to_declared_and_streamed_bodies():
    client = _client(None, limit=2048)
    assert client.post("/v2/models/m/infer", content=b"x" * 2048).json() == {"bytes": 2048}
    declared = client.post("/v2/models/m/infer", content=b"x" * 2049)
    assert declared.status_code == 413 and "2048-byte limit" in declared.json()["error"]
    streamed = client.post("/v2/models/m/infer", content=iter([b"x" * 1500, b"x" * 1500]))
    assert streamed.status_code == 413


def test_key_comes_from_the_file_first_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLANE_TEST_KEY", " from-env \n")
    assert load_api_key("RAYLANE_TEST_KEY", None) == "from-env"
    secret = tmp_path / "key"
    secret.write_text("from-file\n")
    assert load_api_key("RAYLANE_TEST_KEY", secret) == "from-file"
    monkeypatch.delenv("RAYLANE_TEST_KEY")
    assert load_api_key("RAYLANE_TEST_KEY", None) is None


def test_unusable_key_files_are_one_line_errors(tmp_path):
    with pytest.raises(ApiKeyError, match="api_key_file .*missing is unreadable"):
        load_api_key("UNSET", tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ApiKeyError, match="is empty"):
        load_api_key("UNSET", empty)


def test_digest_never_is_the_key():
    assert key_digest("abc") != "abc" and len(key_digest("abc")) == 64
    assert key_digest(None) is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("serving.max_queued_requests=0", "use -1 for no limit"),
        ("serving.surge_percent=101", "surge_percent"),
        ("serving.model_version=0", "model_version"),
        ("serving.max_body_bytes=10", "max_body_bytes"),
    ],
)
def test_bad_serving_settings_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REFERENCE, [override])


def test_load_generator_refuses_other_hosts_and_builds_http11():
    from raylane.serving.loadgen import run_load

    with pytest.raises(ValueError, match="loopback"):
        run_load("http://10.1.2.3:8000", "/x", {}, clients=1, duration_s=0.1)
    request = build_request("http://127.0.0.1:8000", "/p", {"a": 1}, {"X-Request-ID": "r1"})
    head, body = request.split(b"\r\n\r\n")
    assert head.startswith(b"POST /p HTTP/1.1") and b"X-Request-ID: r1" in head
    assert json.loads(body) == {"a": 1} and f"Content-Length: {len(body)}".encode() in head


def test_load_result_percentiles_and_per_status_latencies():
    result = LoadResult()
    for index in range(100):
        status = 200 if index % 10 else 503
        result.events.append((float(index), status, index / 1000))
    result.wall_s = 2.0
    assert result.throughput == 45.0
    assert result.percentile_ms(50) == pytest.approx(50.0)
    assert result.percentile_ms(99) == pytest.approx(99.0)
    assert len(result.latencies_for(503)) == 10
