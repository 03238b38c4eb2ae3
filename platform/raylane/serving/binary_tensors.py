"""The OIP binary tensor data extension: a JSON header followed by raw tensor bytes.

A request (or response) whose `Inference-Header-Content-Length` header is N carries N bytes of
JSON first; tensors whose `parameters.binary_data_size` is set are not in the JSON but follow
it as little-endian bytes, in the order the tensors are listed. Triton's and KServe's clients
send inputs this way by default, which saves the JSON encoding of every value.
"""

from __future__ import annotations

from typing import Any

from raylane.serving.errors import ProtocolError

HEADER_LENGTH = "Inference-Header-Content-Length"


class BinaryBody:
    """A request body cut into its JSON header and the binary tensor bytes after it."""

    def __init__(self, header: bytes, binary: bytes = b""):
        self.header = header
        self._binary = memoryview(binary)
        self._offset = 0

    def take(self, name: str, parameters: dict[str, Any] | None) -> bytes | None:
        """The next `binary_data_size` bytes for tensor `name`, or None for a JSON tensor."""
        size = (parameters or {}).get("binary_data_size")
        if size is None:
            return None
        if type(size) is not int or size < 0:
            raise ProtocolError(
                f"input {name!r}: parameters.binary_data_size must be a byte count, got {size!r}"
            )
        left = len(self._binary) - self._offset
        if size > left:
            raise ProtocolError(
                f"input {name!r}: binary_data_size is {size} but {left} bytes follow the JSON "
                f"header (is the {HEADER_LENGTH} header set?)"
            )
        chunk = self._binary[self._offset : self._offset + size]
        self._offset += size
        return chunk.tobytes()

    def check_consumed(self) -> None:
        left = len(self._binary) - self._offset
        if left:
            raise ProtocolError(
                f"{left} bytes after the JSON header belong to no input's binary_data_size"
            )


def split_body(body: bytes, header_length: str | None) -> BinaryBody:
    """Cut `body` at `header_length` (the header's value; None: the body is all JSON).

    Raises:
        ProtocolError: the header is not a byte count within the body.
    """
    if header_length is None:
        return BinaryBody(body)
    value = header_length.strip()
    if not value.isdigit() or not 0 < int(value) <= len(body):
        raise ProtocolError(
            f"{HEADER_LENGTH} is {header_length!r}; it must be the JSON header's byte count, "
            f"1 to the body's {len(body)} bytes"
        )
    length = int(value)
    return BinaryBody(body[:length], body[length:])


def pack_body(header_json: bytes, chunks: list[bytes]) -> tuple[bytes, dict[str, str]]:
    """A response body and its headers: plain JSON, or JSON + binary tensors appended."""
    if not chunks:
        return header_json, {"content-type": "application/json"}
    return b"".join([header_json, *chunks]), {
        "content-type": "application/octet-stream",
        HEADER_LENGTH.lower(): str(len(header_json)),
    }
