import numpy as np
import pytest

from raylane.serving.protocol import (
    InferenceRequest,
    PredictRequest,
    ProtocolError,
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
