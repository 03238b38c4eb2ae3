"""The Serve application over real HTTP on 127.0.0.1: OIP v2, /predict, batching, 4xx."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from raylane.config import load_config

from .conftest import REFERENCE, free_port
from .triton import triton_infer, triton_metadata

MODEL = "digits"


@pytest.fixture(scope="module")
def endpoint(trained, workspace):
    """The champion deployed on the session cluster; Serve is shut down after the module."""
    from raylane.serving.app import deploy, shutdown_serve

    cfg = load_config(
        REFERENCE,
        workspace.overrides(
            f"serving.port={free_port()}",
            "serving.autoscaling.max_replicas=1",
            "serving.batch_wait_timeout_s=0.05",
        ),
    )
    url, _ = deploy(cfg)
    try:
        yield url
    finally:
        shutdown_serve()


@pytest.fixture(scope="module")
def validation_rows(trained):
    cfg, _ = trained
    table = pq.read_table(cfg.data.validation_path)
    features = np.stack(table.column("features").to_numpy(zero_copy_only=False))
    return features.astype(np.float32)[:60], table.column("label").to_numpy()[:60]


def _infer_body(rows: np.ndarray, datatype: str = "FP32") -> dict:
    return {
        "id": "t-1",
        "inputs": [
            {
                "name": "features",
                "shape": list(rows.shape),
                "datatype": datatype,
                "data": rows.reshape(-1).tolist(),
            }
        ],
    }


def test_v2_infer_answers_with_the_champions_predictions(endpoint, trained, validation_rows):
    _, outcome = trained
    features, labels = validation_rows
    response = httpx.post(f"{endpoint}/v2/models/{MODEL}/infer", json=_infer_body(features))
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["model_name"] == MODEL and payload["id"] == "t-1"
    assert payload["model_version"] == str(outcome.model_version)
    outputs = {o["name"]: o for o in payload["outputs"]}
    assert outputs["logits"]["shape"] == [len(features), 10]
    predicted = np.array(outputs["label"]["data"])
    assert (predicted == labels).mean() >= 0.9
    logits = np.array(outputs["logits"]["data"]).reshape(len(features), 10)
    np.testing.assert_array_equal(logits.argmax(axis=1), predicted)


def test_infer_can_select_outputs_and_accepts_nested_int_data(endpoint, validation_rows):
    features, labels = validation_rows
    body = {
        "inputs": [
            {
                "name": "features",
                "shape": [3, 64],
                "datatype": "INT32",
                "data": features[:3].astype(int).tolist(),
            }
        ],
        "outputs": [{"name": "label"}],
    }
    response = httpx.post(f"{endpoint}/v2/models/{MODEL}/infer", json=body)
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    assert [o["name"] for o in outputs] == ["label"]
    assert outputs[0]["data"] == labels[:3].tolist()


def test_predict_route_takes_plain_rows(endpoint, validation_rows):
    features, labels = validation_rows
    response = httpx.post(f"{endpoint}/predict", json={"instances": features[:20].tolist()})
    assert response.status_code == 200, response.text
    payload = response.json()
    assert (np.array(payload["predictions"]) == labels[:20]).mean() >= 0.9
    np.testing.assert_allclose(np.array(payload["probabilities"]).sum(axis=1), 1.0, atol=1e-4)


def test_health_metadata_and_docs(endpoint, trained):
    _, outcome = trained
    assert httpx.get(f"{endpoint}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{endpoint}/v2/health/ready").json() == {"ready": True}
    assert httpx.get(f"{endpoint}/v2/models/{MODEL}/ready").status_code == 200
    metadata = httpx.get(f"{endpoint}/v2/models/{MODEL}").json()
    assert metadata["versions"] == [str(outcome.model_version)]
    assert metadata["inputs"][0]["shape"] == [-1, 64]
    assert metadata["run_id"] == outcome.run_id
    assert httpx.get(f"{endpoint}/docs").status_code == 200
    paths = httpx.get(f"{endpoint}/openapi.json").json()["paths"]
    assert "/v2/models/{name}/infer" in paths and "/predict" in paths


def test_concurrent_requests_are_batched(endpoint, validation_rows):
    features, _ = validation_rows
    url = f"{endpoint}/v2/models/{MODEL}/infer"
    before = httpx.get(f"{endpoint}/v2/models/{MODEL}/stats").json()["model_stats"][0]

    def send(index: int) -> int:
        row = features[index % len(features)][None, :]
        with httpx.Client(timeout=30) as client:
            return client.post(url, json=_infer_body(row)).status_code

    with ThreadPoolExecutor(max_workers=32) as pool:
        statuses = list(pool.map(send, range(128)))
    assert statuses == [200] * 128
    after = httpx.get(f"{endpoint}/v2/models/{MODEL}/stats").json()["model_stats"][0]
    assert after["requests"] - before["requests"] == 128
    assert after["batches"] - before["batches"] < 128
    assert after["max_batch_size"] > 1


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (f"/v2/models/{MODEL}/infer", b"{not json", 422, "JSON"),
        (f"/v2/models/{MODEL}/infer", {"inputs": []}, 422, "inputs"),
        (f"/v2/models/{MODEL}/infer", {"instances": [[1]]}, 422, "inputs"),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
            400,
            "has 3 features, the model takes 64",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "x", "shape": [2, 64], "datatype": "FP32", "data": [0] * 64}]},
            400,
            "data holds 64 values but shape [2, 64] needs 128",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP99", "data": [0] * 64}]},
            422,
            "datatype",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "BYTES", "data": ["a"] * 64}]},
            400,
            "BYTES is not supported",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": ["a"] * 64}]},
            400,
            "must hold FP32 values only",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {
                "inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}],
                "outputs": [{"name": "embedding"}],
            },
            400,
            "unknown output 'embedding'",
        ),
        (
            "/v2/models/unknown/infer",
            {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}]},
            404,
            "model 'unknown' is not served here",
        ),
        ("/predict", {"instances": [[0] * 63]}, 400, "instances[0] has 63 features"),
        ("/predict", {"instances": [["x"] * 64]}, 422, "instances"),
        ("/predict", {"instances": [[0] * 64] * 1025}, 413, "1025 instances"),
    ],
)
def test_client_mistakes_get_a_4xx_that_names_the_problem(endpoint, path, body, status, message):
    if isinstance(body, bytes):
        response = httpx.post(
            f"{endpoint}{path}", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = httpx.post(f"{endpoint}{path}", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_unknown_model_metadata_is_404(endpoint):
    response = httpx.get(f"{endpoint}/v2/models/nope")
    assert response.status_code == 404
    assert "not served here" in response.json()["error"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_triton_client_gets_the_champions_predictions(endpoint, trained, validation_rows, binary):
    _, outcome = trained
    features, labels = validation_rows
    logits, predicted, response = triton_infer(endpoint, MODEL, features, "FP32", binary)
    assert logits.shape == (len(features), 10) and logits.dtype == np.float32
    assert (predicted == labels).mean() >= 0.9
    np.testing.assert_array_equal(logits.argmax(axis=1), predicted)
    sent_as_binary = [
        "binary_data_size" in (o.get("parameters") or {}) for o in response["outputs"]
    ]
    assert sent_as_binary == [binary, binary]
    # The same rows over plain JSON give the same logits, to float32 precision.
    plain = httpx.post(f"{endpoint}/v2/models/{MODEL}/infer", json=_infer_body(features)).json()
    np.testing.assert_allclose(logits.reshape(-1), plain["outputs"][0]["data"], rtol=1e-6)
    # A client that names the served version reaches it; another version is a 404.
    _, by_version, _ = triton_infer(
        endpoint, MODEL, features[:2], "FP32", binary, version=str(outcome.model_version)
    )
    assert by_version.tolist() == predicted[:2].tolist()
    missing = httpx.post(
        f"{endpoint}/v2/models/{MODEL}/versions/999/infer", json=_infer_body(features[:1])
    )
    assert missing.status_code == 404 and "version 999" in missing.json()["error"]


def test_triton_client_reads_server_and_model_metadata(endpoint):
    ready, server, model = triton_metadata(endpoint, MODEL)
    assert ready is True
    assert "binary_tensor_data" in server["extensions"]
    assert model["inputs"][0]["shape"] == [-1, 64]


def _binary_request(rows: np.ndarray, declared_bytes: int | None = None) -> tuple[bytes, dict]:
    raw = rows.astype("<f4").tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": list(rows.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": declared_bytes or len(raw)},
                }
            ]
        }
    ).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header))}


def test_requests_without_content_type_are_answered(endpoint, validation_rows):
    features, labels = validation_rows
    body = json.dumps(_infer_body(features[:4])).encode()
    response = httpx.post(f"{endpoint}/v2/models/{MODEL}/infer", content=body)
    assert "content-type" not in response.request.headers
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][1]["data"] == labels[:4].tolist()


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda body, headers: (body[:-4], headers), "but 252 bytes follow"),
        (lambda body, headers: (body + b"\0\0\0\0", headers), "4 bytes after the JSON header"),
        (lambda body, headers: (body, {"Inference-Header-Content-Length": "x"}), "byte count"),
        (lambda body, headers: (body, {"Inference-Header-Content-Length": "99999"}), "byte count"),
        (lambda body, headers: (body, {}), "not valid JSON"),
    ],
    ids=["short", "trailing", "header-not-a-number", "header-past-body", "header-missing"],
)
def test_malformed_binary_bodies_get_a_4xx_that_names_the_problem(
    endpoint, validation_rows, mangle, message
):
    features, _ = validation_rows
    body, headers = mangle(*_binary_request(features[:1]))
    response = httpx.post(f"{endpoint}/v2/models/{MODEL}/infer", content=body, headers=headers)
    assert 400 <= response.status_code < 500, response.text
    assert message in response.json()["error"]


def test_binary_tensor_with_the_wrong_byte_count_for_its_shape_is_a_400(endpoint, validation_rows):
    features, _ = validation_rows
    body, headers = _binary_request(features[:2], declared_bytes=256)
    body = body[: len(body) - 256]  # 2 rows declared in the shape, one row's bytes sent
    response = httpx.post(f"{endpoint}/v2/models/{MODEL}/infer", content=body, headers=headers)
    assert response.status_code == 400, response.text
    assert "needs 512" in response.json()["error"]
