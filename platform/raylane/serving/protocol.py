"""Open Inference Protocol (v2, the KServe/Triton REST protocol) messages and their checks.

Requests carry tensors as `shape` + `datatype` + row-major `data` (JSON), or, with the binary
tensor data extension, as raw little-endian bytes after the JSON header
(`raylane.serving.binary_tensors`). Every check here raises `ProtocolError` with a message that
names the problem; the server answers it with a 4xx.

Tensors are checked with numpy in bulk, not element by element in Python: per-request Python
work is what bounds a replica's throughput (benchmarks/README.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raylane.serving.binary_tensors import pack_body, split_body
from raylane.serving.errors import ProtocolError

# OIP datatypes that can carry model features, and the (little-endian) numpy type of each.
NUMERIC_DATATYPES: dict[str, np.dtype] = {
    name: np.dtype(kind).newbyteorder("<")
    for name, kind in {
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
    }.items()
}
# numpy kinds that JSON data of each datatype family may parse into ('b' bool, 'i' int, 'f').
_JSON_KINDS = {"BO": "b", "UI": "i", "IN": "i", "FP": "if"}
OUTPUT_NAMES = ("logits", "label")
Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip


class RequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="Input tensor name.")
    shape: list[int] = Field(..., min_length=1, description="Tensor shape, e.g. [N, 64].")
    datatype: Datatype = Field(..., description="OIP datatype, e.g. FP32.")
    data: list[Any] | None = Field(
        None,
        description="Tensor contents, row-major (flat or nested). Omitted when the tensor is "
        "sent as binary data (parameters.binary_data_size).",
    )
    parameters: dict[str, Any] | None = None


class RequestOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data: true returns this output as raw bytes."
    )


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, description="Echoed in the response.")
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data_output: true returns every output as raw bytes."
    )
    inputs: list[RequestInput] = Field(..., min_length=1, max_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


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


@dataclass(frozen=True)
class InferCall:
    """A checked inference request: its id, feature rows, and how to answer."""

    id: str | None
    rows: np.ndarray
    outputs: tuple[str, ...]  # names to answer with, in order
    binary_outputs: frozenset[str]  # those to send as raw bytes


def decode_infer(
    body: bytes, header_length: str | None, input_dim: int, max_rows: int, dtype: str
) -> InferCall:
    """Parse and check an infer request body (JSON, or JSON header + binary tensors).

    Raises:
        ProtocolError: 422 for a body that is not an inference request, 400 (413 for too
            many rows) for a tensor that does not fit the model or its binary data.
    """
    framed = split_body(body, header_length)
    try:
        request = InferenceRequest.model_validate_json(framed.header)
    except ValidationError as exc:
        raise ProtocolError(_first_error(exc), 422) from None
    tensor = request.inputs[0]
    binary = framed.take(tensor.name, tensor.parameters)
    framed.check_consumed()
    # JSON true/false anywhere in the header: look for bools in the data (numpy would read them
    # as numbers); without them, the per-element look is skipped.
    may_hold_bools = b"true" in framed.header or b"false" in framed.header
    rows = tensor_to_rows(
        tensor, input_dim, max_rows, binary=binary, dtype=dtype, may_hold_bools=may_hold_bools
    )
    outputs, binary_outputs = _requested_outputs(request)
    return InferCall(request.id, rows, outputs, binary_outputs)


def _first_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return f"body is not valid JSON: {first['msg']}"
    where = ".".join(str(part) for part in first.get("loc", ()))
    return f"{where}: {first['msg']}" if where else first["msg"]


def _requested_outputs(request: InferenceRequest) -> tuple[tuple[str, ...], frozenset[str]]:
    all_binary = bool((request.parameters or {}).get("binary_data_output", False))
    if not request.outputs:
        return OUTPUT_NAMES, frozenset(OUTPUT_NAMES if all_binary else ())
    names, binary = [], set()
    for output in request.outputs:
        if output.name not in OUTPUT_NAMES:
            raise ProtocolError(f"unknown output {output.name!r}; known: {', '.join(OUTPUT_NAMES)}")
        parameters = output.parameters or {}
        if parameters.get("classification"):
            raise ProtocolError(f"output {output.name!r}: classification is not supported")
        names.append(output.name)
        if parameters.get("binary_data", all_binary):
            binary.add(output.name)
    return tuple(names), frozenset(binary)


def tensor_to_rows(
    tensor: RequestInput,
    input_dim: int,
    max_rows: int,
    binary: bytes | None = None,
    dtype: str = "float32",
    may_hold_bools: bool = True,
) -> np.ndarray:
    """Check an input tensor against the model and return it as `dtype` rows `[N, input_dim]`.

    `binary` holds the tensor's raw bytes when it was sent with the binary extension.
    """
    name = tensor.name
    if tensor.datatype not in NUMERIC_DATATYPES:
        raise ProtocolError(
            f"input {name!r}: datatype {tensor.datatype} is not supported; "
            "send a numeric type such as FP32"
        )
    shape = _rows_shape(tensor, input_dim, max_rows)
    wire = NUMERIC_DATATYPES[tensor.datatype]
    if binary is not None:
        if tensor.data is not None:
            raise ProtocolError(f"input {name!r}: has both data and binary_data_size")
        needed = math.prod(shape) * wire.itemsize
        if len(binary) != needed:
            raise ProtocolError(
                f"input {name!r}: binary data holds {len(binary)} bytes but shape "
                f"{tensor.shape} of {tensor.datatype} needs {needed}"
            )
        values = np.frombuffer(binary, dtype=wire)
    elif tensor.data is None:
        raise ProtocolError(f"input {name!r}: has neither data nor parameters.binary_data_size")
    else:
        values = _json_values(tensor, wire, may_hold_bools)
        if values.size != math.prod(shape):
            raise ProtocolError(
                f"input {name!r}: data holds {values.size} values but shape {tensor.shape} "
                f"needs {math.prod(shape)}"
            )
    return _to_model_dtype(name, values.reshape(shape), np.dtype(dtype))


def _rows_shape(tensor: RequestInput, input_dim: int, max_rows: int) -> list[int]:
    name, shape = tensor.name, tensor.shape
    if any(dim < 0 for dim in shape):
        raise ProtocolError(f"input {name!r}: shape {shape} has a negative dimension")
    if len(shape) > 2:
        raise ProtocolError(
            f"input {name!r}: shape {shape} must be [N, {input_dim}] or [{input_dim}]"
        )
    rows_shape = [1, shape[0]] if len(shape) == 1 else list(shape)
    if rows_shape[1] != input_dim:
        raise ProtocolError(
            f"input {name!r}: shape {shape} has {rows_shape[1]} features, "
            f"the model takes {input_dim}"
        )
    if rows_shape[0] < 1 or rows_shape[0] > max_rows:
        raise ProtocolError(
            f"input {name!r}: {rows_shape[0]} rows, expected 1 to {max_rows} per request",
            status=413 if rows_shape[0] > max_rows else 400,
        )
    return rows_shape


def _json_values(tensor: RequestInput, wire: np.dtype, may_hold_bools: bool) -> np.ndarray:
    """JSON `data` (flat or nested lists) as a flat array of the datatype's values."""
    wrong_type = ProtocolError(
        f"input {tensor.name!r}: data must hold {tensor.datatype} values only"
    )
    try:
        parsed = np.asarray(tensor.data)
    except (ValueError, OverflowError):  # ragged nesting, or an integer beyond 64 bits
        raise wrong_type from None
    kind = parsed.dtype.kind if parsed.size else "f"
    if kind == "u":  # integers above INT64's range parse as uint64
        kind = "i"
    if kind not in _JSON_KINDS[tensor.datatype[:2]]:
        raise wrong_type
    if kind != "b" and may_hold_bools and _holds_bool(tensor.data):  # true/false: not numbers
        raise wrong_type
    parsed = parsed.reshape(-1)
    if wire.kind in "iu" and parsed.size:
        limits = np.iinfo(wire)
        if parsed.min() < limits.min or parsed.max() > limits.max:
            raise ProtocolError(
                f"input {tensor.name!r}: values do not fit {tensor.datatype} "
                f"({limits.min} to {limits.max})"
            )
    return parsed.astype(wire, copy=False)


def _holds_bool(data: list[Any]) -> bool:
    stack = [data]
    while stack:
        for value in stack.pop():
            if type(value) is bool:
                return True
            if type(value) is list:
                stack.append(value)
    return False


def _to_model_dtype(name: str, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise ProtocolError(f"input {name!r}: data holds NaN or infinite values")
    if dtype.kind in "iu" and values.dtype.kind == "f" and (values != np.round(values)).any():
        raise ProtocolError(f"input {name!r}: the model takes whole numbers (token ids)")
    return values.astype(dtype, copy=False)


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


def output_tensors(logits: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
    """The outputs every model answers with, by name: (OIP datatype, array)."""
    return {
        "logits": ("FP32", logits.astype(np.float32, copy=False)),
        "label": ("INT64", logits.argmax(axis=1).astype(np.int64)),
    }


def logits_to_outputs(logits: np.ndarray) -> list[ResponseOutput]:
    """The two outputs as JSON tensors (`logits` and the predicted `label`)."""
    return [
        ResponseOutput(
            name=name, shape=list(array.shape), datatype=datatype, data=array.reshape(-1).tolist()
        )
        for name, (datatype, array) in output_tensors(logits).items()
    ]


def encode_infer(
    model_name: str, model_version: str, call: InferCall, logits: np.ndarray
) -> tuple[bytes, dict[str, str]]:
    """The response body and headers for `call`: the requested outputs, JSON or binary."""
    tensors = output_tensors(logits)
    outputs, chunks = [], []
    for name in call.outputs:
        datatype, array = tensors[name]
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in call.binary_outputs:
            raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = array.reshape(-1).tolist()
        outputs.append(entry)
    header: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if call.id is not None:
        header["id"] = call.id
    header["outputs"] = outputs
    return pack_body(json.dumps(header, separators=(",", ":")).encode(), chunks)
