"""Open Inference Protocol (v2, the KServe/Triton REST protocol) messages and their checks.

Requests carry tensors as `shape` + `datatype` + row-major `data`. Every check here raises
`ProtocolError` with a message that names the problem; the ingress answers it with a 4xx.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

# OIP datatypes that can carry model features, and the numpy type each is read as.
NUMERIC_DATATYPES: dict[str, type] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
# JSON value types each datatype family accepts (keyed by the datatype's first two letters).
_PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {
    "BO": bool,
    "UI": int,
    "IN": int,
    "FP": (int, float),
}
Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip


class ProtocolError(ValueError):
    """A client mistake in an inference request; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class RequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Input tensor name.")
    shape: list[int] = Field(..., min_length=1, description="Tensor shape, e.g. [N, 64].")
    datatype: Datatype = Field(..., description="OIP datatype, e.g. FP32.")
    data: list[Any] = Field(..., description="Tensor contents, row-major (flat or nested).")
    parameters: dict[str, Any] | None = None


class RequestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, description="Echoed in the response.")
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput] = Field(..., min_length=1, max_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class PredictRequest(BaseModel):
    """The convenience format: plain JSON rows of raw features."""

    model_config = ConfigDict(extra="forbid")

    instances: list[list[float]] = Field(
        ..., min_length=1, description="Feature rows, e.g. [[0, 0, 5, 13, ...], ...]."
    )


class PredictResponse(BaseModel):
    model_name: str
    model_version: str
    predictions: list[int]
    probabilities: list[list[float]]


def _flatten(data: list[Any]) -> list[Any]:
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def tensor_to_rows(tensor: RequestInput, input_dim: int, max_rows: int) -> np.ndarray:
    """Check an input tensor against the model and return it as float32 `[N, input_dim]`."""
    if tensor.datatype not in NUMERIC_DATATYPES:
        raise ProtocolError(
            f"input {tensor.name!r}: datatype {tensor.datatype} is not supported; "
            "send a numeric type such as FP32"
        )
    if any(dim < 0 for dim in tensor.shape):
        raise ProtocolError(f"input {tensor.name!r}: shape {tensor.shape} has a negative dimension")
    if len(tensor.shape) == 1:
        shape = [1, tensor.shape[0]]
    elif len(tensor.shape) == 2:
        shape = tensor.shape
    else:
        raise ProtocolError(
            f"input {tensor.name!r}: shape {tensor.shape} must be [N, {input_dim}] or [{input_dim}]"
        )
    if shape[1] != input_dim:
        raise ProtocolError(
            f"input {tensor.name!r}: shape {tensor.shape} has {shape[1]} features, "
            f"the model takes {input_dim}"
        )
    if shape[0] < 1 or shape[0] > max_rows:
        raise ProtocolError(
            f"input {tensor.name!r}: {shape[0]} rows, expected 1 to {max_rows} per request",
            status=413 if shape[0] > max_rows else 400,
        )
    flat = _flatten(tensor.data)
    if len(flat) != math.prod(shape):
        raise ProtocolError(
            f"input {tensor.name!r}: data holds {len(flat)} values but shape {tensor.shape} "
            f"needs {math.prod(shape)}"
        )
    if not all(isinstance(v, _PYTHON_TYPES[tensor.datatype[:2]]) for v in flat) or (
        tensor.datatype != "BOOL" and any(isinstance(v, bool) for v in flat)
    ):
        raise ProtocolError(f"input {tensor.name!r}: data must hold {tensor.datatype} values only")
    try:
        values = np.asarray(flat, dtype=NUMERIC_DATATYPES[tensor.datatype])
    except (OverflowError, ValueError) as exc:
        raise ProtocolError(
            f"input {tensor.name!r}: values do not fit {tensor.datatype} ({exc})"
        ) from None
    rows = values.astype(np.float32).reshape(shape)
    if not np.isfinite(rows).all():
        raise ProtocolError(f"input {tensor.name!r}: data holds NaN or infinite values")
    return rows


def instances_to_rows(request: PredictRequest, input_dim: int, max_rows: int) -> np.ndarray:
    """Check `/predict` rows against the model and return them as float32 `[N, input_dim]`."""
    if len(request.instances) > max_rows:
        raise ProtocolError(
            f"{len(request.instances)} instances, expected at most {max_rows} per request", 413
        )
    for index, row in enumerate(request.instances):
        if len(row) != input_dim:
            raise ProtocolError(
                f"instances[{index}] has {len(row)} features, the model takes {input_dim}"
            )
    rows = np.asarray(request.instances, dtype=np.float32)
    if not np.isfinite(rows).all():
        raise ProtocolError("instances hold NaN or infinite values")
    return rows


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def logits_to_outputs(logits: np.ndarray) -> list[ResponseOutput]:
    """The two outputs every model answers with: `logits` and the predicted `label`."""
    labels = logits.argmax(axis=1)
    return [
        ResponseOutput(
            name="logits",
            shape=list(logits.shape),
            datatype="FP32",
            data=logits.astype(np.float32).reshape(-1).tolist(),
        ),
        ResponseOutput(name="label", shape=[len(labels)], datatype="INT64", data=labels.tolist()),
    ]
