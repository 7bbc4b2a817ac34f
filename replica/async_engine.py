"""Async streaming over LLMEngine: the step loop runs in one background thread.

The engine is not thread-safe, so every mutation (add, abort, step) happens on the engine
thread; asyncio callers talk to it through a command queue and get their deltas through
per-request asyncio queues. Closing or cancelling a stream aborts its request, which frees
its KV blocks at once. KV events and stats are collected after every step for the index
publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from kvmesh.kvcache import KVEvent
from kvmesh.replica.engine import EngineStats, LLMEngine, Prompt
from kvmesh.replica.request import Request, RequestOutput
from kvmesh.replica.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineDeadError(RuntimeError):
    """The engine thread failed; requests in flight were ended with this error."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: refused at once instead of queueing without bound."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._events_lock = threading.Lock()
        self._events: list[KVEvent] = []
        self._events_waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._stats = engine.stats()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas for one request. Validation errors raise ``ValueError`` before any delta."""
        if self._stopped.is_set():
            raise EngineDeadError("engine is shut down")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.engine.prepare_request(prompt, params, request_id)  # validates in the caller
        limit = self.engine.config.max_queued_requests
        if self.num_waiting() >= limit:
            raise EngineOverloadedError(f"replica queue is full ({limit} waiting requests)")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(("add", request))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> bool:
        """Abort a request streaming from this engine; False if there is none by that id."""
        if request_id not in self._streams:
            return False
        self._commands.put(("abort", request_id))
        return True

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._commands.put(("call", (fn, loop, future)))
        return await future

    async def snapshot_cached_hashes(self) -> set[int]:
        """The cache's hashes, consistent with the event stream: events drained after this
        call describe changes made after the snapshot (earlier ones are discarded)."""

        def snapshot(engine: LLMEngine) -> set[int]:
            with self._events_lock:
                self._events.clear()
            engine.drain_kv_events()
            return engine.block_manager.cached_hashes()

        return await self.call(snapshot)

    def num_waiting(self) -> int:
        """Requests not yet running: queued in the engine or still on their way to it."""
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    def num_streams(self) -> int:
        return len(self._streams)

    def drain_kv_events(self) -> list[KVEvent]:
        with self._events_lock:
            events, self._events = self._events, []
            if self._events_waiter is not None:
                self._events_waiter[1].clear()
        return events

    async def wait_kv_events(self, timeout: float) -> None:
        """Return when KV events are pending, or after ``timeout`` seconds."""
        with self._events_lock:
            if self._events_waiter is None:
                self._events_waiter = (asyncio.get_running_loop(), asyncio.Event())
            event = self._events_waiter[1]
            if self._events:
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stopped.is_set():
            block = not self.engine.has_unfinished_requests()
            try:
                self._apply_commands(block)
                outputs = self.engine.step()
            except Exception as exc:  # a bug or device failure: fail loudly, keep serving new requests
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._publish(outputs)

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                kind, arg = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self.engine.abort(arg)
            elif kind == "call":
                self._run_call(*arg)
            elif kind == "stop":
                return

    def _run_call(self, fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    def _add(self, request: Request) -> None:
        if request.request_id not in self._streams:
            return  # the caller went away before the engine saw it
        try:
            self.engine.submit(request)
        except Exception as exc:
            self._deliver(request.request_id, exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out)
        events = self.engine.drain_kv_events()
        if events:
            with self._events_lock:
                self._events.extend(events)
                if self._events_waiter is not None:
                    loop, event = self._events_waiter
                    loop.call_soon_threadsafe(event.set)
        self._stats = self.engine.stats()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, EngineDeadError(f"engine step failed: {exc}"))
        self.engine.step()  # flush the abort outputs nobody will read


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return  # the caller was cancelled
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
