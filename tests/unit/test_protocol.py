import json

import numpy as np
import pytest

from raylane.serving.protocol import (
    InferenceRequest,
    PredictRequest,
    ProtocolError,
    decode_infer,
    encode_infer,
    instances_to_rows,
    logits_to_outputs,
    softmax,
    tensor_to_rows,
)


def _tensor(shape, data, datatype="FP32"):
    return InferenceRequest.model_validate(
        {"inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": data}]}
    ).inputs[0]


def test_flat_and_nested_data_give_the_same_rows():
    flat = tensor_to_rows(_tensor([2, 3], [1, 2, 3, 4, 5, 6]), 3, 10)
    nested = tensor_to_rows(_tensor([2, 3], [[1, 2, 3], [4, 5, 6]]), 3, 10)
    assert flat.dtype == np.float32 and flat.shape == (2, 3)
    np.testing.assert_array_equal(flat, nested)


def test_one_dimensional_tensor_is_one_row():
    assert tensor_to_rows(_tensor([3], [1, 2, 3], "INT32"), 3, 10).shape == (1, 3)


@pytest.mark.parametrize(
    ("shape", "data", "datatype", "message", "status"),
    [
        ([2, 4], [0] * 8, "FP32", "has 4 features, the model takes 3", 400),
        ([2, 3], [0] * 5, "FP32", "data holds 5 values but shape [2, 3] needs 6", 400),
        ([1, 1, 3], [0] * 3, "FP32", "must be [N, 3] or [3]", 400),
        ([1, 3], ["a", "b", "c"], "FP32", "must hold FP32 values only", 400),
        ([1, 3], [1.5, 2, 3], "INT64", "must hold INT64 values only", 400),
        ([1, 3], [True, 2, 3], "FP32", "must hold FP32 values only", 400),
        ([1, 3], ["a", "b", "c"], "BYTES", "datatype BYTES is not supported", 400),
        ([1, 3], [300, 1, 2], "UINT8", "do not fit UINT8", 400),
        ([11, 3], [0] * 33, "FP32", "11 rows, expected 1 to 10", 413),
        ([0, 3], [], "FP32", "0 rows", 400),
        ([-1, 3], [0] * 3, "FP32", "negative dimension", 400),
    ],
)
def test_bad_tensors_name_the_problem(shape, data, datatype, message, status):
    with pytest.raises(ProtocolError) as info:
        tensor_to_rows(_tensor(shape, data, datatype), 3, 10)
    assert message in str(info.value)
    assert info.value.status == status


def test_predict_rows_are_checked():
    rows = instances_to_rows(PredictRequest(instances=[[1, 2, 3]]), 3, 10)
    assert rows.shape == (1, 3)
    with pytest.raises(ProtocolError, match=r"instances\[1\] has 2 features"):
        instances_to_rows(PredictRequest(instances=[[1, 2, 3], [1, 2]]), 3, 10)


def test_outputs_carry_logits_and_labels():
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]], dtype=np.float32)
    outputs = {o.name: o for o in logits_to_outputs(logits)}
    assert outputs["label"].data == [1, 0]
    assert outputs["logits"].shape == [2, 3] and len(outputs["logits"].data) == 6
    np.testing.assert_allclose(softmax(logits).sum(axis=1), 1.0, rtol=1e-6)


def _binary_body(rows: np.ndarray, datatype="FP32", extra: bytes = b"", **request):
    raw = rows.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(rows.shape),
                    "datatype": datatype,
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            **request,
        }
    ).encode()
    return header + raw + extra, str(len(header))


def test_binary_tensors_decode_to_the_same_rows_as_json():
    rows = np.arange(6, dtype="<f4").reshape(2, 3)
    body, length = _binary_body(rows)
    call = decode_infer(body, length, 3, 10, "float32")
    json_body = json.dumps({"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32",
                                        "data": rows.tolist()}]}).encode()  # fmt: skip
    np.testing.assert_array_equal(call.rows, decode_infer(json_body, None, 3, 10, "float32").rows)
    assert call.binary_outputs == frozenset()


def test_int64_tokens_arrive_as_the_models_dtype():
    tokens = np.array([[1, 255, 7]], dtype="<i8")
    body, length = _binary_body(tokens, "INT64")
    rows = decode_infer(body, length, 3, 10, "int64").rows
    assert rows.dtype == np.int64 and rows.tolist() == [[1, 255, 7]]
    fractional = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32",
                                         "data": [1.5, 2, 3]}]}).encode()  # fmt: skip
    with pytest.raises(ProtocolError, match="whole numbers"):
        decode_infer(fractional, None, 3, 10, "int64")


@pytest.mark.parametrize(
    ("body_and_length", "message"),
    [
        (lambda b, n: (b[:-4], n), "binary_data_size is 24 but 20 bytes follow"),
        (lambda b, n: (b + b"\0", n), "1 bytes after the JSON header"),
        (lambda b, n: (b, "0"), "must be the JSON header's byte count"),
        (lambda b, n: (b, str(len(b) + 1)), "must be the JSON header's byte count"),
    ],
)
def test_malformed_binary_bodies_name_the_problem(body_and_length, message):
    body, length = body_and_length(*_binary_body(np.zeros((2, 3), dtype="<f4")))
    with pytest.raises(ProtocolError, match=message) as info:
        decode_infer(body, length, 3, 10, "float32")
    assert info.value.status == 400


def test_binary_data_size_must_match_the_shape():
    body, length = _binary_body(np.zeros((1, 3), dtype="<f4"))
    body = body.replace(b'"shape": [1, 3]', b'"shape": [2, 3]')
    length = str(int(length))
    with pytest.raises(ProtocolError, match="holds 12 bytes but shape \\[2, 3\\] of FP32 needs 24"):
        decode_infer(body, length, 3, 10, "float32")


def test_outputs_come_back_binary_when_asked():
    body, length = _binary_body(
        np.zeros((2, 3), dtype="<f4"), parameters={"binary_data_output": True}
    )
    call = decode_infer(body, length, 3, 10, "float32")
    logits = np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32)
    payload, headers = encode_infer("m", "3", call, logits)
    header_length = int(headers["inference-header-content-length"])
    header = json.loads(payload[:header_length])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sizes == [16, 16] and len(payload) == header_length + 32
    raw = payload[header_length:]
    np.testing.assert_array_equal(np.frombuffer(raw[:16], "<f4").reshape(2, 2), logits)
    assert np.frombuffer(raw[16:], "<i8").tolist() == [1, 0]


def test_json_outputs_and_unknown_or_unsupported_outputs():
    body = json.dumps({"id": "7", "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32",
                       "data": [1, 2, 3]}], "outputs": [{"name": "label"}]}).encode()  # fmt: skip
    call = decode_infer(body, None, 3, 10, "float32")
    payload, headers = encode_infer("m", "3", call, np.array([[0.0, 1.0]], dtype=np.float32))
    assert headers == {"content-type": "application/json"}
    answer = json.loads(payload)
    assert answer["id"] == "7" and [o["name"] for o in answer["outputs"]] == ["label"]
    assert answer["outputs"][0]["data"] == [1]
    for outputs, message in (([{"name": "emb"}], "unknown output 'emb'"),
                             ([{"name": "label", "parameters": {"classification": 2}}],
                              "classification is not supported")):  # fmt: skip
        bad = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32",
                          "data": [1, 2, 3]}], "outputs": outputs}).encode()  # fmt: skip
        with pytest.raises(ProtocolError, match=message):
            decode_infer(bad, None, 3, 10, "float32")


def test_not_json_or_not_a_request_is_422():
    for body in (b"{nope", b'{"instances": [[1, 2, 3]]}', b'{"inputs": []}'):
        with pytest.raises(ProtocolError) as info:
            decode_infer(body, None, 3, 10, "float32")
        assert info.value.status == 422
