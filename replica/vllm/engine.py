"""A real vLLM server as a replica's engine: it keeps the engine's face
(``kvmesh.engine.protocol.ServingEngine``), so the replica's gRPC service, OpenAI front end,
index publisher and metrics work unchanged.

- ``generate``: the replica's token ids to vLLM's ``/v1/completions`` (prompt as token ids,
  streamed, token ids back), its deltas as ``RequestOutput``; vLLM's refusals as the errors
  kvmesh's engine raises.
- KV events: vLLM's, re-hashed by kvmesh's chain (``cache_view.py``), gap-free
  (``subscriber.py``); a view that lost events is dropped and vLLM's cache reset, so what
  the index shows is what vLLM holds.
- ``stats``: vLLM's own metrics (running, waiting, KV usage, prefix-cache counters), read
  once a heartbeat; the step costs are fitted from the timings vLLM reports per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.protocol import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    PrefixFacts,
    RequestOutput,
    RequestTimes,
    TokenLogprob,
)
from kvmesh.engine.step_costs import StepCostFit
from kvmesh.kvcache import AllBlocksCleared, KVCacheError, KVCacheStats, KVEvent, block_hashes
from kvmesh.kvcache.events import CachedBlocks
from kvmesh.replica.vllm.cache_view import CacheView
from kvmesh.replica.vllm.server import VllmServer
from kvmesh.replica.vllm.subscriber import EventSubscriber
from kvmesh.serving.background import BackgroundLoops, cancel
from kvmesh.serving.errors import RequestFailed
from kvmesh.serving.sampling_params import SamplingParams

log = logging.getLogger(__name__)
RESET_RETRY_S = 1.0  # vLLM refuses to reset its cache while requests hold blocks


@dataclass
class _VllmLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


class VllmEngine:
    def __init__(self, server: VllmServer, config: EngineConfig, block_size: int, hash_seed: int):
        self.server = server
        self.config = config
        self.block_size, self.hash_seed = block_size, hash_seed
        self.view = CacheView(block_size, hash_seed)
        self.started_at = time.monotonic()
        self._client: httpx.AsyncClient | None = None
        self._events: list[KVEvent] = []
        self._events_ready = asyncio.Event()
        self.subscriber = EventSubscriber(
            server.events_endpoint, server.replay_endpoint, self.view, self._add_events, self._view_lost
        )
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> its stream from vLLM
        self._load = _VllmLoad()
        self._fit = StepCostFit()
        self._prompt_tokens = self._generation_tokens = self._failed = 0
        self._loops = BackgroundLoops()
        self._reset_pending: asyncio.Task | None = None
        self._stopped = False

    async def start(self) -> None:
        """Start vLLM and wait for it; the event stream is followed from its first batch."""
        headers = {"Authorization": f"Bearer {self.server.token}"} if self.server.token else {}
        self._client = httpx.AsyncClient(
            base_url=self.server.url, headers=headers, timeout=httpx.Timeout(None, connect=5.0)
        )
        self._loops.start(self.subscriber.run, "kvmesh-vllm-events")
        self.server.start()
        await asyncio.to_thread(self.server.wait_ready, self._answers)
        await self.refresh_load()
        self._loops.start(self._follow_load, "kvmesh-vllm-load")

    async def models(self) -> list[dict]:
        """vLLM's ``/v1/models`` (its served name and ``max_model_len``)."""
        response = await self._client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"]

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.server.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    # ------------------------------------------------------------------ requests

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas from vLLM (refusals raised before any delta)."""
        if (reason := self.health()) is not None:
            raise EngineDeadError(reason)
        if request_id in self._tasks:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.prompt_logprobs is not None:  # vLLM computes them only for unstreamed requests
            raise ValueError("prompt_logprobs are not served by vLLM replicas")
        hashes = block_hashes(prompt, self.block_size, self.hash_seed)
        arrived = time.monotonic()
        known = [self.view.stored_at(h) for h in hashes]
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._stream(prompt, params, request_id, queue))
        self._tasks[request_id] = task
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished:
                    item.prefix = self._facts(hashes, known, item.cached_tokens, arrived)
                yield item
        finally:
            self._tasks.pop(request_id, None)
            if not task.done():
                await cancel(task)  # closing the HTTP stream aborts the request in vLLM

    def abort(self, request_id: str) -> bool:
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    async def _stream(self, prompt: list[int], params: SamplingParams, request_id: str, queue) -> None:
        started = time.monotonic()
        out = _Progress(request_id, len(prompt), params.logprobs)
        self._prompt_tokens += len(prompt)
        body = _completion_body(self.server.options.served_name, prompt, params)
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise _refusal(response.status_code, (await response.aread()).decode(errors="replace"))
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    delta = out.read(json.loads(line[6:]))
                    if delta is not None:
                        self._generation_tokens += len(delta.new_token_ids)
                        queue.put_nowait(delta)
            if not out.finished:
                raise RequestFailed("vLLM ended the stream without a finish reason")
            self._learn_costs(out, len(self._tasks))
            queue.put_nowait(out.last(started, time.monotonic()))
        except asyncio.CancelledError:
            queue.put_nowait(out.aborted(started))
            raise
        except httpx.HTTPError as exc:
            queue.put_nowait(EngineDeadError(f"vLLM unreachable: {exc}"))
        except (ValueError, EngineOverloadedError, EngineDeadError, RequestFailed) as exc:
            if isinstance(exc, RequestFailed):
                self._failed += 1
            queue.put_nowait(exc)

    def _facts(self, hashes: list[int], known: list[float | None], cached_tokens: int, arrived: float):
        """What the view said of the prompt's blocks on arrival, set against vLLM's hit:
        a hit block the view never held is dated to the engine's start (an old miss in the
        index: a lie), one it learned of since arrival is young (an event in flight)."""
        hits = min(cached_tokens // self.block_size, len(hashes))
        stored = []
        for h, at in zip(hashes[:hits], known, strict=False):
            stored.append(at if at is not None else self.view.stored_at(h) or self.started_at)
        miss = self.view.evicted_at(hashes[hits]) if hits < len(hashes) else None
        return PrefixFacts(hashes[0] if hashes else None, tuple(stored), miss, arrived)

    def _learn_costs(self, out: _Progress, streams: int) -> None:
        """Two samples a request from vLLM's own timings: its prefill (first token less its
        queue) and its mean decode step, each with the streams in flight beside it."""
        m = out.metrics
        ttft, queued, itl = m.get("time_to_first_token_ms"), m.get("queue_time_ms"), m.get("mean_itl_ms")
        context = out.prompt_tokens + out.completion_tokens // 2
        if ttft is not None and queued is not None:
            uncached = out.prompt_tokens - out.cached_tokens
            self._fit.observe(
                uncached, max(0, streams - 1), context * max(0, streams - 1), (ttft - queued) / 1e3
            )
        if itl and out.completion_tokens > 1:
            self._fit.observe(0, max(1, streams), context * max(1, streams), itl / 1e3)

    # ------------------------------------------------------------------ KV events

    def _add_events(self, events: list[KVEvent]) -> None:
        if events:
            self._events.extend(events)
            self._events_ready.set()

    def _view_lost(self, why: str) -> None:
        """The view is empty now: the index follows at once (the publisher resyncs on the
        clear), and vLLM's cache is reset so that empty is true again."""
        self._add_events([AllBlocksCleared()])
        if self._reset_pending is None or self._reset_pending.done():
            self._reset_pending = asyncio.ensure_future(self._reset_cache())

    async def _reset_cache(self) -> None:
        while not self._stopped and self.subscriber.lost is not None:
            with contextlib.suppress(httpx.HTTPError):
                response = await self._client.post("/reset_prefix_cache")
                if response.status_code == 200 and response.json().get("success"):
                    return  # its AllBlocksCleared event marks the view exact
            await asyncio.sleep(RESET_RETRY_S)

    async def snapshot_cached_blocks(self) -> CachedBlocks:
        self._events.clear()
        self._events_ready.clear()
        return CachedBlocks(self.view.cached_blocks(), self.view.host_blocks())

    async def cached_hashes(self) -> set[int]:
        """The hashes a new request could hit now, as vLLM's events say (for checks)."""
        return set(self.view.cached_blocks())

    def drain_kv_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        self._events_ready.clear()
        return events

    async def wait_kv_events(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._events_ready.wait(), timeout)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (experiments start cold); ``KVCacheError`` while requests
        hold blocks. vLLM sends its AllBlocksCleared only at its next step: the view and the
        index are cleared now, as vLLM said it did."""
        response = await self._client.post("/reset_prefix_cache")
        if response.status_code != 200 or not response.json().get("success"):
            raise KVCacheError("vLLM did not reset its prefix cache: requests still hold blocks")
        self.view.clear()
        self._add_events([AllBlocksCleared()])

    async def recount_cache(self) -> None:
        """Make the view vLLM's cache again before a resync: replay every batch vLLM holds,
        else reset its cache (then the empty view is exact)."""
        if not await self.subscriber.rebuild():
            await self._reset_cache()

    def drop_next_stored_event(self) -> None:
        """Fault injection: the next batch of stored blocks never reaches the view, as if lost
        unseen (each call loses one more batch)."""
        self.subscriber.drop_stored_batches += 1

    # ------------------------------------------------------------------ load and health

    async def _follow_load(self, period_s: float = 1.0) -> None:
        while self._loops.running:
            await asyncio.sleep(period_s)
            with contextlib.suppress(httpx.HTTPError, ValueError):
                await self.refresh_load()

    async def refresh_load(self) -> None:
        """Read vLLM's metrics (what the heartbeat reports)."""
        text = (await self._client.get("/metrics")).text
        self._load = _parse_load(text, self._load.num_blocks)

    def stats(self) -> EngineStats:
        load = self._load
        used = round(load.kv_usage * load.num_blocks)
        kv = KVCacheStats(
            num_blocks=load.num_blocks,
            block_size=self.block_size,
            num_used_blocks=used,
            num_free_blocks=max(0, load.num_blocks - used),
            num_cached_free_blocks=max(0, min(len(self.view), load.num_blocks - used)),
            num_cached_hashes=len(self.view),
            prefix_query_tokens=load.prefix_queries,
            prefix_hit_tokens=load.prefix_hits,
            evictions=0,
        )
        return EngineStats(
            num_running=load.running,
            num_waiting=load.waiting,
            num_preemptions=load.preemptions,
            num_failed_requests=self._failed,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            kv=kv,
            step_costs=self._fit.costs(),
            step_cost_samples=self._fit.steps,
        )

    def num_streams(self) -> int:
        return len(self._tasks)

    def health(self) -> str | None:
        if self._stopped:
            return "engine is shut down"
        return self.server.exited()

    def fail_streams(self, reason: str) -> None:
        for task in list(self._tasks.values()):
            task.cancel()

    async def stop(self) -> None:
        self._stopped = True
        await self._loops.stop()
        await cancel(self._reset_pending)
        if self._client is not None:
            await self._client.aclose()
        await asyncio.to_thread(self.server.stop)
        self.subscriber.close()


class _Progress:
    """One request's stream from vLLM, read chunk by chunk."""

    def __init__(self, request_id: str, prompt_tokens: int, top_logprobs: int | None = None):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.top_logprobs = top_logprobs  # alternatives per token the client asked for
        self.completion_tokens = self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.metrics: dict = {}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def read(self, chunk: dict) -> RequestOutput | None:
        """A chunk's delta (None for the usage chunk, which ends the stream)."""
        if "error" in chunk:
            raise RequestFailed(str(chunk["error"].get("message", chunk["error"]))[:500])
        if usage := chunk.get("usage"):
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self.metrics = chunk.get("metrics") or {}
        choices = chunk.get("choices") or ()
        if not choices:
            return None
        choice = choices[0]
        ids = list(choice.get("token_ids") or ())
        if ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.completion_tokens += len(ids)
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if not ids and not choice.get("text"):
            return None
        out = self._output(ids, choice.get("text") or "", finished=False)
        if (logprobs := choice.get("logprobs")) is not None:
            out.logprobs = _token_logprobs(ids, logprobs, self.top_logprobs)
        return out

    def _output(self, ids: list[int], text: str, finished: bool, reason: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=ids,
            new_text=text,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )

    def last(self, started: float, now: float) -> RequestOutput:
        out = self._output([], "", True, self.finish_reason)
        queued = self.metrics.get("queue_time_ms")
        scheduled = None if queued is None else started + queued / 1e3
        out.times = RequestTimes(started, scheduled, self.first_token_at, now)
        return out

    def aborted(self, started: float) -> RequestOutput:
        out = self._output([], "", True, "abort")
        out.times = RequestTimes(started, None, self.first_token_at, time.monotonic())
        return out


def _completion_body(model: str, prompt: list[int], p: SamplingParams) -> dict:
    """The request vLLM's ``/v1/completions`` gets: kvmesh's parameters by vLLM's names."""
    body = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "min_p": p.min_p,
        "ignore_eos": p.ignore_eos,
        "stop": p.stop,
        "stop_token_ids": p.stop_token_ids,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "min_tokens": p.min_tokens,
    }
    if p.seed is not None:
        body["seed"] = p.seed
    if p.logprobs is not None:  # raw log-probabilities (vLLM's default mode, as kvmesh's engine)
        body.update(logprobs=p.logprobs, return_tokens_as_token_ids=True)
    if p.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    return body


def _token_logprobs(ids: list[int], logprobs: dict, k: int | None) -> list[TokenLogprob]:
    """vLLM's completion logprobs (tokens as ``token_id:N``) as kvmesh's: each token's
    log-probability, its ``k`` best alternatives, best first, and its rank where it is one of
    them (0 where it is not: vLLM's answer does not say how far below it lies)."""
    scored = []
    for token, logprob, top in zip(ids, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        ranked = sorted(
            ((int(name.removeprefix("token_id:")), value) for name, value in (top or {}).items()),
            key=lambda pair: -pair[1],
        )[: k or 0]
        rank = next((i for i, (t, _) in enumerate(ranked, start=1) if t == token), 0)
        scored.append(TokenLogprob(token, logprob, rank, tuple(ranked)))
    return scored


def _refusal(status: int, body: str) -> Exception:
    """vLLM's HTTP error as the exception kvmesh's engine raises for the same cause."""
    try:
        message = json.loads(body).get("error", {}).get("message") or body
    except (ValueError, AttributeError):
        message = body
    message = str(message)[:500]
    if status in (400, 422):
        return ValueError(message)
    if status in (429, 503):
        return EngineOverloadedError(message)
    if status == 401:
        return EngineDeadError("vLLM refused the replica's token")
    return RequestFailed(f"vLLM answered {status}: {message}")


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
}


def _parse_load(text: str, num_blocks: int) -> _VllmLoad:
    """vLLM's Prometheus text as the load a heartbeat reports (summed over its engines)."""
    load = _VllmLoad(num_blocks=num_blocks)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in _GAUGES:
                field = _GAUGES[name]
                kind = float if field == "kv_usage" else int
                setattr(load, field, getattr(load, field) + kind(sample.value))
            elif name == "vllm:cache_config_info" and sample.labels.get("num_gpu_blocks", "").isdigit():
                load.num_blocks = int(sample.labels["num_gpu_blocks"])
    return load
