"""Async streaming over LLMEngine: the step loop runs in one background thread.

The engine is not thread-safe, so everything that reads or changes its state (admission
checks, the per-request seed, add, abort, step) happens on the engine thread; asyncio
callers send it typed commands through one queue and get their deltas through per-request
asyncio queues. Closing or cancelling a stream aborts its request, which frees its KV
blocks at once. KV events and a stats snapshot are published after every step for the
index publisher and the metrics.

A request that fails alone in a step gets ``serving.errors.RequestFailed``; a step that fails for
every request gets its requests ``EngineDeadError`` (the caller may retry elsewhere). An
engine that cannot step any more (``LLMEngine.broken``) fails what it holds and refuses new
work, and ``health()`` says so, as it does for a step loop that stopped making progress
(a stuck kernel): the replica then fails what it holds (``fail_streams``), leaves the index
and its supervisor replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.llm_engine import LLMEngine, Prompt
from kvmesh.engine.protocol import EngineDeadError, EngineOverloadedError, EngineStats
from kvmesh.engine.request import RequestOutput
from kvmesh.kvcache import KVEvent
from kvmesh.kvcache.events import CachedBlocks
from kvmesh.serving.errors import RequestFailed
from kvmesh.serving.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


# Commands to the engine thread, applied between steps in the order they were sent.
@dataclass(frozen=True)
class _Add:
    prompt: Prompt
    params: SamplingParams | None
    request_id: str


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop


# A step loop with work that has not finished a loop turn for this long is stalled. A step on
# a GPU takes well under a second, so several seconds without one is a stuck kernel (a false
# stall costs a replica: its supervisor replaces it, hence not less); on CPU one prefill step
# of a large model can take many seconds.
GPU_STALL_S = 5.0
CPU_STALL_S = 60.0


def default_stall_s(device_type: str) -> float:
    return GPU_STALL_S if device_type == "cuda" else CPU_STALL_S


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, stall_s: float | None = None):
        """``stall_s``: None for the default of the engine's device (``default_stall_s``)."""
        self.engine = engine
        self.stall_s = stall_s or default_stall_s(engine.runner.device.type)
        self._turn_at = time.monotonic()  # when the step loop last finished a turn or woke up
        self._idle = True  # waiting for a command, with nothing to step
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
        """Stream deltas for one request. Refusals (``ValueError`` for bad input,
        ``EngineOverloadedError`` for a full queue, ``EngineDeadError`` while the engine
        cannot serve) are raised before any delta."""
        if (reason := self.health()) is not None:
            raise EngineDeadError(reason)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:  # the streams belong to this side; the engine checks its own
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(_Add(prompt, params, request_id))
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
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> bool:
        """Abort a request streaming from this engine; False if there is none by that id."""
        if request_id not in self._streams:
            return False
        self._commands.put(_Abort(request_id))
        return True

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._commands.put(_Call(fn, loop, future))
        return await future

    async def snapshot_cached_blocks(self) -> CachedBlocks:
        """The cache's hashes in both tiers (each with its chain's root), consistent with the
        event stream: events drained after this call describe changes made after the snapshot
        (earlier ones are discarded)."""

        def snapshot(engine: LLMEngine) -> CachedBlocks:
            with self._events_lock:
                self._events.clear()
            engine.drain_kv_events()
            host = engine.block_manager.host
            return CachedBlocks(engine.block_manager.cached_blocks(), host.cached_blocks() if host else {})

        return await self.call(snapshot)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    async def cached_hashes(self) -> set[int]:
        """The hashes a new request could hit now (for checks against the index)."""
        return await self.call(lambda e: e.block_manager.cached_hashes())

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (experiments start cold); ``KVCacheError`` while requests hold blocks."""
        await self.call(lambda engine: engine.reset_prefix_cache())

    async def recount_cache(self) -> None:
        """Nothing to do before a resync: the block ledger is the cache (a vLLM engine's view
        of its cache, ``replica/vllm``, may have to be rebuilt)."""

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
        """The snapshot taken after the last step (safe to read from any thread)."""
        return self._stats

    def health(self) -> str | None:
        """None while the engine serves, else why it does not: it is broken, its thread
        ended, or its step loop has had work and not finished a turn for ``stall_s``."""
        if self.engine.broken:
            return f"engine broken: {self.engine.broken}"
        if self._stopped.is_set():
            return "engine is shut down"
        if not self._thread.is_alive():
            return "engine thread ended"
        stuck = time.monotonic() - self._turn_at
        if not self._idle and stuck > self.stall_s:
            return f"engine step loop stalled: no turn finished for {stuck:.0f} s with work waiting"
        return None

    def fail_streams(self, reason: str) -> None:
        """End every request streaming from this engine with ``EngineDeadError(reason)``: its
        step loop will not deliver them (stalled, or its thread ended). Callers move those
        that produced nothing yet elsewhere; the others end with the error."""
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(reason))

    async def stop(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._commands.put(_Stop())
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._idle = not self.engine.has_unfinished_requests()  # waits for a command: not stalled
            try:
                self._apply_commands(block=self._idle)
                self._idle, self._turn_at = False, time.monotonic()
                outputs = [] if self.engine.broken else self.engine.step()
            except Exception as exc:  # a bug outside the forward: the step's requests cannot go on
                log.exception("engine step failed")
                self.engine.note_failed_step(exc)
                self._fail_all(f"engine step failed: {exc}")
                continue
            finally:
                self._turn_at = time.monotonic()
            self._publish(outputs)
            if self.engine.broken and self.engine.requests:
                log.error("engine broken: failing its requests", extra={"error": self.engine.broken})
                self._fail_all(f"engine broken: {self.engine.broken}")

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                command: _Command = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            match command:
                case _Add():
                    self._add(command)
                case _Abort(request_id):
                    self.engine.abort(request_id)
                case _Call(fn, loop, future):
                    self._run_call(fn, loop, future)
                case _Stop():
                    return

    def _run_call(self, fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:  # the caller's function failed: its awaiter gets the error
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    def _add(self, command: _Add) -> None:
        """Admit a request: validate it against the engine (vocabulary, lengths, pool, a
        duplicate id), refuse it if the queue is full, draw its seed, queue it."""
        if command.request_id not in self._streams:
            return  # the caller went away before the engine saw it
        limit = self.engine.config.max_queued_requests
        try:
            if self.engine.broken:
                raise EngineDeadError(f"engine broken: {self.engine.broken}")
            if len(self.engine.scheduler.waiting) >= limit:
                raise EngineOverloadedError(f"replica queue is full ({limit} waiting requests)")
            request = self.engine.prepare_request(command.prompt, command.params, command.request_id)
            self.engine.submit(request)
        except (ValueError, EngineOverloadedError, EngineDeadError) as exc:  # refused: the caller gets why
            self._deliver(command.request_id, exc)
        except Exception as exc:  # a bug: this request fails loudly, the engine keeps serving
            log.exception("admitting a request failed", extra={"request_id": command.request_id})
            self._deliver(command.request_id, exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        # The step's stats first: a client told its request finished must not then scrape it as
        # still running (the loop may run the client before this thread's next line).
        self._stats = self.engine.stats()
        for out in outputs:
            self._deliver(out.request_id, _failure(out) if out.error else out)
        events = self.engine.drain_kv_events()
        if events:
            with self._events_lock:
                self._events.extend(events)
                if self._events_waiter is not None:
                    loop, event = self._events_waiter
                    loop.call_soon_threadsafe(event.set)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, EngineDeadError(message))
        self.engine.step()  # flush the abort outputs nobody will read


def _failure(out: RequestOutput) -> Exception:
    """A failed request's error: the engine's fault may be retried elsewhere, its own not."""
    return EngineDeadError(out.error) if out.engine_fault else RequestFailed(out.error)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return  # the caller was cancelled
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
