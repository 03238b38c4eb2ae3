"""Request guard: API-key check and body-size limit, as one ASGI middleware in each replica.

The key is read where the application is built (the deploying machine, or the cluster for
`serve deploy`) from a secret file or an environment variable; replicas receive only its
SHA-256 digest, so the key itself never reaches Ray's logs, dashboard or task arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from raylane.serving.errors import route_path, send_json_error

# Open without a key: probes and the API description. Everything else needs it when set.
OPEN_PATHS = ("/v2/health/", "/docs", "/openapi.json", "/redoc")


class ApiKeyError(ValueError):
    """The configured key source is unusable; the message names it (never the key)."""


def load_api_key(env_var: str, key_file: Path | None) -> str | None:
    """The API key from `key_file` (wins) or `$env_var`; None when neither sets one."""
    if key_file is not None:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise ApiKeyError(
                f"serving.api_key_file {key_file} is unreadable ({exc.strerror})"
            ) from None
        if not key:
            raise ApiKeyError(f"serving.api_key_file {key_file} is empty")
        return key
    key = os.environ.get(env_var, "").strip()
    return key or None


def key_digest(key: str | None) -> str | None:
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()


@dataclass
class GuardSettings:
    key_digest: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024


class RequestGuard:
    """Pure ASGI middleware (no per-request task or body copy, unlike BaseHTTPMiddleware).

    401 without the right `Authorization: Bearer <key>` on guarded paths; 413 when the
    declared or the streamed body exceeds the limit. `settings` is filled in by the replica.
    """

    def __init__(self, app, settings: GuardSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings = self.settings
        headers = dict(scope.get("headers") or ())
        if _needs_key(settings, route_path(scope)) and not _authorised(
            headers.get(b"authorization", b""), settings.key_digest
        ):
            return await send_json_error(
                send,
                401,
                "missing or wrong API key: send Authorization: Bearer <key>",
                [(b"www-authenticate", b"Bearer")],
            )
        limit = settings.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await send_json_error(send, 413, f"request body over the {limit}-byte limit")

        received = 0
        started = rejected = False

        async def counted_receive():
            # Frameworks turn exceptions raised while reading the body into their own 400, so
            # an over-long stream is answered here and the app sees the client as gone.
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if not started and not rejected:
                        rejected = True
                        await send_json_error(
                            send, 413, f"request body over the {limit}-byte limit"
                        )
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message):
            nonlocal started
            if rejected:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except Exception:
            if not rejected:  # after a 413 the app's complaint about the cut body is moot
                raise


def _needs_key(settings: GuardSettings, path: str) -> bool:
    return settings.key_digest is not None and not path.startswith(OPEN_PATHS)


def _authorised(header: bytes, digest: str) -> bool:
    scheme, _, token = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).hexdigest(), digest)
