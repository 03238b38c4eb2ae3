"""The error every request check raises, how a raw ASGI route answers it, and the error a
deploy raises before anything starts when the registered versions cannot be served."""

import json


class ProtocolError(ValueError):
    """A client mistake in an inference request; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def route_path(scope) -> str:
    """The request's path within its Serve application: Serve gives an application under a
    route prefix that prefix as the ASGI `root_path` and leaves it in `path`."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


class ServedModelError(ValueError):
    """The registered versions a config names cannot be served as it asks (one line)."""


async def send_json_error(send, status: int, message: str, extra_headers=()) -> None:
    """Answer an ASGI request with `{"error": message}` and `status`."""
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra_headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
