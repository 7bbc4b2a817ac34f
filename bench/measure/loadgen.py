"""Load generator, gRPC (token ids, to kvmesh) or OpenAI HTTP (text, to any router): closed
loop or open loop (Poisson / trace timestamps), always bounded.

Every request becomes one record: when it was sent, its first token and its end, tokens,
which replica served it, what the router predicted it would reuse and what the engine
actually reused. Failures are records too (``error``), never silently dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

import grpc

from kvmesh.bench.measure.workloads import Segment, WorkloadRequest
from kvmesh.protos import pb, pb_grpc


@dataclass
class RequestRecord:
    index: int
    group: str
    policy: str
    prompt_tokens: int
    model: str = ""  # the model it named (a mix of models)
    completion_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    replica_id: str = ""
    router_decision_us: int = 0
    sent_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    def as_dict(self) -> dict:
        return asdict(self)


async def _one(
    stub, index: int, req: WorkloadRequest, policy: str, t0: float, timeout_s: float
) -> RequestRecord:
    prompt = req.tokens()
    record = RequestRecord(index, req.group, policy, len(prompt), req.model)
    sampling = pb.SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
    message = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=sampling,
        policy=policy,
        affinity_key=req.session,
        model=req.model,
    )
    record.sent_s = time.perf_counter() - t0
    try:
        async for response in stub.Generate(message, timeout=timeout_s):
            if response.WhichOneof("kind") == "chunk":
                if record.first_token_s is None:
                    record.first_token_s = time.perf_counter() - t0
                record.completion_tokens += len(response.chunk.token_ids)
            else:
                c = response.complete
                record.cached_tokens = c.usage.cached_tokens
                record.predicted_cached_tokens = c.predicted_cached_tokens
                record.replica_id = c.replica_id
                record.router_decision_us = c.router_decision_us
        record.done_s = time.perf_counter() - t0
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    return record


async def _http_one(
    http,
    index: int,
    req: WorkloadRequest,
    prompt: str,
    label: str,
    t0: float,
    timeout_s: float,
    model: str,
    answer: list[str] | None = None,
) -> RequestRecord:
    """One streamed OpenAI /v1/completions call (text prompt); usage carries the cached tokens.
    ``answer``: where the generated text goes, when the caller needs it (conversations)."""
    record = RequestRecord(index=index, group=req.group, policy=label, prompt_tokens=0)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record.sent_s = time.perf_counter() - t0
    try:
        async with http.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"in-band error: {event['error']}")
                text = event["choices"][0].get("text") if event.get("choices") else None
                if text and record.first_token_s is None:
                    record.first_token_s = time.perf_counter() - t0
                if text and answer is not None:
                    answer.append(text)
                if usage := event.get("usage"):
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.completion_tokens = usage["completion_tokens"]
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
        record.done_s = time.perf_counter() - t0
    except Exception as exc:  # a record, never a lost request: connection errors, timeouts, bad replies
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _drive(
    requests: Sequence[WorkloadRequest],
    send: Callable[[int, WorkloadRequest, float], Awaitable[RequestRecord]],
    concurrency: int,
    rate: float | None,
    use_arrival_times: bool,
    seed: int,
    label: str,
    progress: bool,
) -> list[RequestRecord]:
    """Schedule ``send(i, request, t0)``: closed loop (``concurrency`` at a time), Poisson
    ``rate`` per second, or each request's ``arrival_s``; open loops are still bounded."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(requests), desc=f"load {label}", unit="req", disable=not progress)
    t0 = time.perf_counter()

    async def fire(i: int, req: WorkloadRequest) -> RequestRecord:
        async with limit:
            record = await send(i, req, t0)
        bar.update(1)
        return record

    tasks, at = [], 0.0
    for i, req in enumerate(requests):
        if use_arrival_times:
            at = req.arrival_s
        elif rate:
            at += rng.expovariate(rate)
        if at:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        tasks.append(asyncio.create_task(fire(i, req)))
    records = await asyncio.gather(*tasks)
    bar.close()
    return list(records)


async def run_load(
    address: str | Sequence[str],
    requests: Sequence[WorkloadRequest],
    policy: str = "",
    concurrency: int = 16,
    rate: float | None = None,
    use_arrival_times: bool = False,
    timeout_s: float = 300.0,
    seed: int = 0,
    progress: bool = False,
) -> list[RequestRecord]:
    """Send ``requests`` as token ids over gRPC to a kvmesh router, or spread them over several
    (request i to router i mod n, as a client-side balancer would); see ``_drive`` for timing."""
    addresses = [address] if isinstance(address, str) else list(address)
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pb_grpc.RouterStub(c) for c in channels]
    try:
        return await _drive(
            requests,
            lambda i, req, t0: _one(stubs[i % len(stubs)], i, req, policy, t0, timeout_s),
            concurrency,
            rate,
            use_arrival_times,
            seed,
            policy or "default",
            progress,
        )
    finally:
        for channel in channels:
            await channel.close()


async def run_http_load(
    base_url: str,
    requests: Sequence[WorkloadRequest],
    prompts: Sequence[str],
    label: str,
    model: str,
    concurrency: int = 16,
    rate: float | None = None,
    timeout_s: float = 300.0,
    seed: int = 0,
    progress: bool = False,
    use_arrival_times: bool = False,
) -> list[RequestRecord]:
    """Send ``prompts[i]`` (the text of ``requests[i]``) to any OpenAI-compatible server, streamed
    (``model`` is required by some routers, e.g. sglang-router); see ``_drive`` for timing."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as http:
        return await _drive(
            requests,
            lambda i, req, t0: _http_one(http, i, req, prompts[i], label, t0, timeout_s, model),
            concurrency,
            rate,
            use_arrival_times,
            seed,
            label,
            progress,
        )


async def run_http_conversations(
    base_url: str,
    conversations: Sequence[Sequence[WorkloadRequest]],
    text: Callable[[Segment], str],
    label: str,
    model: str,
    concurrency: int = 16,
    timeout_s: float = 300.0,
) -> list[RequestRecord]:
    """Multi-turn chat, closed loop, against any OpenAI-compatible server: up to
    ``concurrency`` conversations at once, each sending its next turn when the previous
    answer is complete. A turn's prompt is the previous prompt + the answer the server
    actually gave + the new user message (so what a replica cached is what comes back);
    ``conversations[s][t]`` gives turn t's user message (its last segment) and, on turn 0,
    the system prompt (its first); ``text`` renders a segment. A failed turn ends its
    conversation (recorded)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    limit = asyncio.Semaphore(concurrency)
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def converse(http, turns: Sequence[WorkloadRequest]) -> None:
        async with limit:
            history = text(turns[0].segments[0])
            for req in turns:
                prompt = history + text(req.segments[-1])
                answer: list[str] = []
                record = await _http_one(http, len(records), req, prompt, label, t0, timeout_s, model, answer)
                records.append(record)
                if record.error:
                    return
                history = prompt + "".join(answer)

    async with httpx.AsyncClient(base_url=base_url, limits=limits) as http:
        await asyncio.gather(*(converse(http, turns) for turns in conversations))
    return records
