"""Which model a generation request names: the served model, or a LoRA adapter of its base.

A replica serves `serving.model_name`, and, with `serving.generation.max_adapters > 0`, any
registered LoRA adapter of the same base, named `<model_name>:<NAME>/<VERSION>` (the OpenAI
`model` field, or the OIP model name). An adapter is loaded from the registry the first time a
request names it, without restarting anything, and installed between two decode steps; up to
`max_adapters` are held at once, the least recently used idle one making room for the next
(`raylane.models.multi_lora.AdapterSet`).
"""

from __future__ import annotations

import asyncio
import re

from raylane.models.multi_lora import AdapterCapacityError
from raylane.serving.errors import ProtocolError
from raylane.serving.generation.loader import load_served_adapter

_ADAPTER = re.compile(r"^(?P<name>[^/:@]+)/(?P<version>[1-9][0-9]*)$")


class AdapterDirectory:
    """Resolves request model names to adapter rows of one replica's engine."""

    def __init__(
        self, model_name: str, served, loop, tracking_uri: str, retry_after_s: float,
        max_adapters: int,
    ):  # fmt: skip
        self.model_name = model_name
        self.max_adapters = max_adapters
        self.served = served  # raylane.serving.generation.loader.GenerationModel
        self.loop = loop  # raylane.serving.generation_loop.GenerationLoop
        self.tracking_uri = tracking_uri
        self.retry_after_s = retry_after_s
        self._loading: dict[str, asyncio.Lock] = {}
        own = served.own_adapter
        self.default_key = own.key if own is not None else None
        if own is not None:
            loop.engine.adapters.add(own.key, own.state, own.scale, pin=True)

    @property
    def adapters(self):
        return self.loop.engine.adapters

    def loaded(self) -> list[str]:
        """Model names of the adapters held now, besides the served model itself."""
        if self.adapters is None:
            return []
        keys = [k for k in self.adapters.rows if k != self.default_key]
        return [f"{self.model_name}:{key}" for key in keys]

    async def acquire(self, name: str) -> int:
        """The adapter row for a request naming model `name` (0: the model alone), held for
        it until the request ends (`GenerationLoop.start` takes it over).

        Raises:
            ProtocolError: 404 naming what is served when `name` is not; 503 with
                Retry-After when every adapter slot is in use.
        """
        if name == self.model_name:
            return self.adapters.acquire(self.default_key) if self.default_key else 0
        key = self._adapter_key(name)
        if key not in self.adapters:
            await self._install(key)
        # No await since the install: nothing could have evicted it in between.
        return self.adapters.acquire(key)

    def _adapter_key(self, name: str) -> str:
        prefix = f"{self.model_name}:"
        match = _ADAPTER.match(name[len(prefix) :]) if name.startswith(prefix) else None
        if match is None:
            raise ProtocolError(
                f"model {name!r} is not served here; available: {self.model_name!r}"
                + (f" and its base's adapters as '{prefix}NAME/VERSION'" if self._open() else ""),
                404,
            )
        if not self._open():
            why = ("serving.generation.max_adapters is 0" if self.served.base
                   else "the served adapter is merged into its base "
                        "(serving.generation.merge_adapter: true)")  # fmt: skip
            raise ProtocolError(f"model {name!r} is not served here: {why}", 404)
        return f"{match['name']}/{match['version']}"

    def _open(self) -> bool:
        """Whether requests may name adapters (beside a served adapter's own pinned row)."""
        return self.max_adapters > 0 and self.served.base is not None

    async def _install(self, key: str) -> None:
        lock = self._loading.setdefault(key, asyncio.Lock())
        try:
            async with lock:  # one download per adapter, however many requests name it at once
                if key not in self.adapters:
                    await self._load_and_add(key)
        finally:
            self._loading.pop(key, None)  # waiters hold the lock itself

    async def _load_and_add(self, key: str) -> None:
        name, version = key.split("/")
        try:
            adapter = await asyncio.to_thread(
                load_served_adapter, self.tracking_uri, name, int(version), self.served.base
            )
        except (LookupError, ValueError, KeyError) as exc:  # KeyError: a malformed adapter.json
            raise ProtocolError(f"model '{self.model_name}:{key}': {exc}", 404) from None
        except Exception as exc:  # noqa: BLE001 - the registry or its store failed, not the client
            raise ProtocolError(
                f"model '{self.model_name}:{key}' could not be loaded from the registry: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                503,
                {"Retry-After": f"{self.retry_after_s:g}"},
            ) from None
        try:
            await self.loop.between_steps(
                lambda: self.adapters.add(adapter.key, adapter.state, adapter.scale)
            )
        except AdapterCapacityError as exc:
            raise ProtocolError(str(exc), 503, {"Retry-After": f"{self.retry_after_s:g}"}) from None
        except ValueError as exc:  # the adapter names layers this model lacks
            raise ProtocolError(f"model '{self.model_name}:{key}': {exc}", 404) from None
