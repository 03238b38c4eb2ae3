"""Calls through Triton's own HTTP client (`tritonclient[http]`), as an OIP user would."""

from __future__ import annotations

from urllib.parse import urlsplit

import numpy as np


def triton_infer(
    url: str, model: str, rows: np.ndarray, datatype: str, binary: bool, version: str = ""
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Logits and labels for `rows` from the endpoint at `url`, and the response's JSON part.

    `binary` sends the input and asks for the outputs as binary tensor data (the client's
    default); otherwise both travel as JSON.
    """
    import tritonclient.http as triton

    client = triton.InferenceServerClient(urlsplit(url).netloc, network_timeout=60.0)
    try:
        tensor = triton.InferInput("features", list(rows.shape), datatype)
        tensor.set_data_from_numpy(rows, binary_data=binary)
        outputs = [
            triton.InferRequestedOutput("logits", binary_data=binary),
            triton.InferRequestedOutput("label", binary_data=binary),
        ]
        result = client.infer(model, [tensor], outputs=outputs, model_version=version)
        return result.as_numpy("logits"), result.as_numpy("label"), result.get_response()
    finally:
        client.close()


def triton_metadata(url: str, model: str) -> tuple[bool, dict, dict]:
    """Server readiness, server metadata and model metadata as tritonclient reads them."""
    import tritonclient.http as triton

    client = triton.InferenceServerClient(urlsplit(url).netloc)
    try:
        return (
            client.is_server_ready(),
            client.get_server_metadata(),
            client.get_model_metadata(model),
        )
    finally:
        client.close()
