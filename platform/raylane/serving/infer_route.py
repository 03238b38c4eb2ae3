"""The OIP infer routes as a pure ASGI handler placed before FastAPI's router.

The infer route carries every inference request, so its per-request Python cost bounds how
many rows a replica answers per second. Through FastAPI's router, dependency resolution and
class-based-view lookup cost about a third of the replica's event-loop time; this handler
matches the path itself, reads the raw body (no Content-Type needed, binary tensors allowed)
and hands it to the replica. Other routes go on to FastAPI unchanged, and the infer routes are
still described in the OpenAPI document (`raylane.serving.openapi`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from raylane.serving.binary_tensors import HEADER_LENGTH
from raylane.serving.errors import ProtocolError, route_path, send_json_error

INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
_HEADER_KEY = HEADER_LENGTH.lower().encode()


class InferHandler(Protocol):
    async def infer_body(
        self, name: str, version: str | None, body: bytes, header_length: str | None
    ) -> tuple[bytes, dict[str, str]]: ...


@dataclass
class InferTarget:
    """Where the route sends requests; the replica sets `handler` once its model is loaded."""

    handler: InferHandler | None = None


class InferRoute:
    """ASGI middleware answering POST /v2/models/{name}[/versions/{v}]/infer itself."""

    def __init__(self, app, target: InferTarget):
        self.app = app
        self.target = target

    async def __call__(self, scope, receive, send):
        match = INFER_PATH.match(route_path(scope)) if scope["type"] == "http" else None
        handler = self.target.handler
        if match is None or handler is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await send_json_error(send, 405, "infer takes POST", [(b"allow", b"POST")])
        body = await _read_body(receive)
        if body is None:  # the client left
            return
        header_length = _header(scope, _HEADER_KEY)
        try:
            payload, headers = await handler.infer_body(
                match.group(1), match.group(2), body, header_length
            )
        except ProtocolError as exc:
            return await send_json_error(send, exc.status, str(exc))
        raw_headers = [(k.encode(), v.encode()) for k, v in headers.items()]
        raw_headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _header(scope: dict[str, Any], key: bytes) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == key:
            return value.decode("latin-1")
    return None
