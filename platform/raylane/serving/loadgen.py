"""A light closed-loop HTTP/1.1 load generator for the benchmark and the serving tests.

Each client holds one keep-alive connection and sends its next request when the previous
answer arrives. Raw asyncio streams, not an HTTP library: on a small machine the client shares
the CPUs with the server, and a heavier client measures itself. Bounded by duration, request
count and an optional stop event; loopback only, since it exists to test our own server.
"""

from __future__ import annotations

import asyncio
import json
import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class LoadResult:
    # (finish time on time.monotonic's clock, status, latency s) for every answered request
    events: list[tuple[float, int, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # connection errors, not HTTP statuses
    headers_by_status: dict[int, dict[str, str]] = field(default_factory=dict)  # first of each
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def statuses(self) -> Counter[int]:
        return Counter(status for _, status, _ in self.events)

    @property
    def latencies_s(self) -> list[float]:
        return [latency for _, _, latency in self.events]

    @property
    def requests(self) -> int:
        return len(self.events)

    @property
    def throughput(self) -> float:
        return self.statuses[200] / self.wall_s if self.wall_s else 0.0

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        if not ordered:
            return float("nan")
        return 1000.0 * ordered[min(len(ordered) - 1, int(q / 100.0 * len(ordered)))]

    def latencies_for(self, status: int) -> list[float]:
        return [latency for _, code, latency in self.events if code == status]

    @property
    def client_cpu_share(self) -> float:
        """CPU the generator itself used, as a fraction of one core."""
        return self.cpu_s / self.wall_s if self.wall_s else 0.0


def build_request(url: str, path: str, body: dict | bytes, headers: dict | None = None) -> bytes:
    parts = urlsplit(url)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.hostname}:{parts.port}",
        f"Content-Length: {len(payload)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in header_lines:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            chunks.append(chunk[:-2])
        body = b"".join(chunks)
    else:
        body = await reader.read()
    return status, headers, body


async def _client(host, port, request, result, deadline, budget, stop: threading.Event | None):
    reader = writer = None
    while time.monotonic() < deadline and budget[0] > 0 and not (stop and stop.is_set()):
        budget[0] -= 1
        started = time.perf_counter()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            await writer.drain()
            status, headers, _ = await _read_response(reader)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            result.failures.append(f"{type(exc).__name__}: {exc}")
            if writer is not None:
                writer.close()
            reader = writer = None
            await asyncio.sleep(0.05)
            continue
        result.events.append((time.monotonic(), status, time.perf_counter() - started))
        result.headers_by_status.setdefault(status, headers)
        if headers.get("connection", "").lower() == "close":
            writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()


async def _load(url, request, clients, duration_s, max_requests, stop) -> LoadResult:
    parts = urlsplit(url)
    if parts.hostname not in LOOPBACK:
        raise ValueError(f"load is only generated against loopback addresses, not {url}")
    result = LoadResult()
    budget = [max_requests]
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    deadline = started + duration_s
    await asyncio.gather(
        *(
            _client(parts.hostname, parts.port, request, result, deadline, budget, stop)
            for _ in range(clients)
        )
    )
    result.wall_s = time.monotonic() - started
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    result.cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (
        cpu_after.ru_stime - cpu_before.ru_stime
    )
    return result


def run_load(
    url: str,
    path: str,
    body: dict | bytes,
    *,
    clients: int = 32,
    duration_s: float = 10.0,
    max_requests: int = 100_000,
    headers: dict | None = None,
    stop: threading.Event | None = None,
) -> LoadResult:
    """Closed-loop load from `clients` connections until time, count or `stop` runs out."""
    request = build_request(url, path, body, headers)
    return asyncio.run(_load(url, request, clients, duration_s, max_requests, stop))


class BackgroundLoad:
    """`run_load` in a thread, for tests that change the server while it is under load."""

    def __init__(self, url: str, path: str, body: dict | bytes, **kwargs):
        self.stop = threading.Event()
        self.result: LoadResult | None = None
        self._thread = threading.Thread(
            target=self._run, args=(url, path, body), kwargs={**kwargs, "stop": self.stop}
        )

    def _run(self, url, path, body, **kwargs):
        self.result = run_load(url, path, body, **kwargs)

    def __enter__(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join()
