"""The replica's generation loop: one `GenerationEngine` stepped in a worker thread while the
event loop keeps answering HTTP, streaming each request's tokens as they come.

Requests and cancellations reach the engine only between steps (the loop applies them), so
the engine is never touched from two threads at once. A request whose client went away is
aborted at the next step boundary: its cache slot is free for the next request immediately.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from raylane.serving.generation.engine import Event, GenerationEngine, Sequence
from raylane.serving.generation.sampling import SamplingParams


@dataclass
class Generation:
    """One request in flight: its sequence once admitted, and the events for its reader."""

    prompt: list[int]
    params: SamplingParams
    adapter: int = 0  # the adapter row acquired for it (0: none)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    sequence: Sequence | None = None
    submitted: float = field(default_factory=time.perf_counter)


class GenerationLoop:
    """Feeds requests into `engine` and its events back to each request's reader."""

    def __init__(self, engine: GenerationEngine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._adds: list[Generation] = []
        self._aborts: list[Generation] = []
        self._by_id: dict[int, Generation] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stepping = asyncio.Lock()  # held while the engine steps in its thread

    def start(self, prompt: list[int], params: SamplingParams, adapter: int = 0) -> Generation:
        """Queue a request (checked at once: ValueError names why it cannot run). `adapter`:
        a row acquired from the engine's adapters, released when the request ends (also when
        it is refused here)."""
        try:
            self.engine.check(prompt, params)
        except ValueError:
            self._release(adapter)
            raise
        generation = Generation(prompt, params, adapter)
        self._adds.append(generation)
        self._ensure_running()
        self._wake.set()
        return generation

    async def between_steps(self, change):
        """Run `change()` (for instance installing an adapter) while the engine is not
        stepping, and return its result."""
        async with self._stepping:
            return change()

    def cancel(self, generation: Generation) -> None:
        """Stop `generation` at the next step boundary (its client went away)."""
        self._aborts.append(generation)
        self._wake.set()

    async def events(self, generation: Generation) -> AsyncIterator[Event]:
        """`generation`'s events until it finishes; cancelled if the reader stops early."""
        finished = False
        try:
            while not finished:
                event = await generation.events.get()
                if isinstance(event, Exception):  # the step failed: this request with it
                    finished = True
                    raise event
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.cancel(generation)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not (self.engine.busy or self._adds or self._aborts):
                self._wake.clear()
                await self._wake.wait()
            self._apply_requests()
            if not self.engine.busy:
                continue
            started = time.perf_counter()
            try:
                async with self._stepping:
                    events = await asyncio.to_thread(self.engine.step)
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, not the loop
                self._fail_all(exc)
                continue
            if self.metrics is not None:
                self.metrics.record_step(self.engine, len(events), time.perf_counter() - started)
            for event in events:
                generation = self._by_id.get(event.sequence.id)
                if generation is None:
                    continue
                if self.metrics is not None and len(event.sequence.output) == 1:
                    self.metrics.record_first_token(time.perf_counter() - generation.submitted)
                generation.events.put_nowait(event)
                if event.finished:
                    del self._by_id[event.sequence.id]

    def _fail_all(self, exc: Exception) -> None:
        """A step raised: every request in flight ends with `exc`; the loop goes on."""
        error = RuntimeError(f"generation failed: {exc}")
        for generation in list(self._by_id.values()):
            self.engine.abort(generation.sequence)
            generation.events.put_nowait(error)
        self._by_id.clear()

    def _release(self, adapter: int) -> None:
        if adapter:
            self.engine.adapters.release(adapter)

    def _apply_requests(self) -> None:
        aborts, self._aborts = self._aborts, []
        for generation in aborts:
            if generation.sequence is not None:
                self.engine.abort(generation.sequence)
                self._by_id.pop(generation.sequence.id, None)
            elif generation in self._adds:
                self._adds.remove(generation)
                self._release(generation.adapter)
        adds, self._adds = self._adds, []
        for generation in adds:
            generation.sequence = self.engine.add(
                generation.prompt, generation.params, generation.adapter
            )
            self._by_id[generation.sequence.id] = generation
