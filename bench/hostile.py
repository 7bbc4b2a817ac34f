"""The hostile mix of ``kvmesh bench soak --hostile``: bad, oversized, slow and vanishing
requests of every kind a server must hold under, sent beside the ordinary load. Each kind
knows the clean answer it must get (a 400 naming the field, a 413, a connection cut after
the write timeout...); the soak counts the answers that were not, and checks that no
ordinary request failed because of any of them. Beside them, connections are held open
(``held_open.py``): each must be dropped within the server's bounds."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import httpx

from kvmesh.bench.held_open import HeldLog, hold_open
from kvmesh.protos import pb, pb_grpc


@dataclass(frozen=True)
class Target:
    grpc_address: str
    http_url: str
    vocab_size: int
    write_timeout_s: float


@dataclass(frozen=True)
class Seen:
    """An answer that is as it must be, but one of several: counted by what it was."""

    what: str


# A kind sends one hostile request and returns None (or a Seen) when it got an answer it must
# get, else what it got instead.
Kind = Callable[[Target], Awaitable["str | Seen | None"]]


async def _post(target: Target, path: str, expect: int, **kw) -> str | None:
    async with httpx.AsyncClient(base_url=target.http_url, timeout=120) as http:
        reply = await http.post(path, **kw)
    if reply.status_code != expect:
        return f"HTTP {reply.status_code} (expected {expect}): {reply.text[:200]}"
    return None


async def _grpc(target: Target, request: pb.GenerateRequest, expect: grpc.StatusCode) -> str | None:
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        try:
            async for _ in pb_grpc.RouterStub(channel).Generate(request, timeout=120):
                pass
            code, details = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details()
    return None if code == expect else f"{code.name} (expected {expect.name}): {details[:200]}"


def _completion(**fields) -> dict:
    return {"prompt": [5, 6, 7, 8], "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


async def out_of_vocabulary_stop_id(t: Target) -> str | None:
    """The one that used to fail every request beside it and cool the whole fleet down."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[2**32 - 1]),
    )
    return await _grpc(t, request, grpc.StatusCode.INVALID_ARGUMENT)


async def every_token_a_stop_id(t: Target) -> str | None:
    body = _completion(stop_token_ids=list(range(t.vocab_size)), min_tokens=2, temperature=1.0)
    return await _post(t, "/v1/completions", 400, json=body)


async def huge_batch(t: Target) -> str | None:
    data = json.dumps(_completion(prompt=[[5]] * 300_000, max_tokens=1)).encode()  # ~2 MB
    return await _post(t, "/v1/completions", 400, content=data, headers={"content-type": "application/json"})


async def stop_string_flood(t: Target) -> str | None:
    return await _post(t, "/v1/completions", 400, json=_completion(stop=[f"s{i}" for i in range(20_000)]))


async def one_long_stop_string(t: Target) -> str | None:
    return await _post(t, "/v1/completions", 400, json=_completion(stop=["x" * 100_000]))


async def logit_bias_flood(t: Target) -> str | None:
    bias = {str(i % t.vocab_size): 0.5 for i in range(t.vocab_size)} | {
        str(10**6 + i): 1 for i in range(5000)
    }
    return await _post(t, "/v1/completions", 400, json=_completion(logit_bias=bias))


async def megabyte_of_tools(t: Target) -> str | None:
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": "x" * 1000}} for i in range(1000)
    ]
    return await _post(t, "/v1/chat/completions", 400, json=_chat(tools=tools))


async def many_empty_messages(t: Target) -> str | None:
    return await _post(
        t, "/v1/chat/completions", 400, json=_chat(messages=[{"role": "user", "content": ""}] * 100_000)
    )


async def big_tokenize(t: Target) -> str | None:
    """A megabyte of text to /tokenize: served (it takes a slot, and runs off the loop)."""
    return await _post(t, "/tokenize", 200, json={"prompt": "the cache block " * 65_000})


async def made_up_policy(t: Target) -> str | None:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(max_tokens=2),
        policy=f"made-up-{random.randrange(10**9)}",
    )
    return await _grpc(t, request, grpc.StatusCode.INVALID_ARGUMENT)


async def unknown_fields_with_newlines(t: Target) -> str | None:
    forged = {f"x{random.randrange(10**9)}\n00:00:00 error kvmesh forged": 1 for _ in range(50)}
    return await _post(t, "/v1/completions", 200, json=_completion(**forged))


async def oversized_body(t: Target) -> str | None:
    return await _post(
        t, "/v1/completions", 413, content=b"x" * (5 << 20), headers={"content-type": "application/json"}
    )


async def oversized_chunked_body(t: Target) -> str | None:
    async def chunks():
        for _ in range(80):
            yield b"x" * (64 << 10)

    return await _post(
        t, "/v1/completions", 413, content=chunks(), headers={"content-type": "application/json"}
    )


async def shared_request_id(t: Target) -> str | None:
    """Two clients, one request id: neither collides with nor aborts the other."""
    request = pb.GenerateRequest(
        request_id="everyones-id",
        token_ids=pb.TokenIds(ids=[9, 10, 11, 12]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    own = [("grpc.use_local_subchannel_pool", 1)]  # two connections, as two clients have

    async def one() -> str | None:
        async with grpc.aio.insecure_channel(t.grpc_address, own) as channel:
            try:
                responses = [r async for r in pb_grpc.RouterStub(channel).Generate(request, timeout=120)]
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()[:200]}"
        if responses[-1].request_id != "everyones-id" or responses[-1].complete.usage.completion_tokens != 8:
            return "a shared request id was not echoed or its request did not finish"
        return None

    surprises = [s for s in await asyncio.gather(one(), one()) if s]
    return surprises[0] if surprises else None


def _big_stream() -> dict:
    """An answer of about 6 MB (each token with its 20 likeliest others, 8 choices over): more
    than the kernel's and the server's buffers hold, so a client that does not read it makes
    the server's writes wait."""
    prompt = [(7 * j + 3) % 900 + 3 for j in range(1200)]
    return _completion(
        prompt=prompt, echo=True, logprobs=20, n=8, max_tokens=400, ignore_eos=True, stream=True
    )


async def reader_that_stops(t: Target) -> str | Seen | None:
    """Sends that request and never reads: the server must drop the connection once a write
    waited the write timeout (what is buffered then ends without [DONE]), unless the whole
    answer fit in the buffers first; it must never hold the stream open."""
    host, port = t.http_url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(_big_stream()).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    tail = b""
    try:
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, head + payload)
        await asyncio.sleep(t.write_timeout_s + 10)  # reads nothing meanwhile
        while True:  # then reads what was buffered, to the end of the connection
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)
            except ConnectionError:
                break
            except TimeoutError:
                return "the server held the stream open past its write timeout"
            if not chunk:
                break
            tail = (tail + chunk)[-64:]
    finally:
        sock.close()
    return Seen("fit in the buffers, finished" if b"[DONE]" in tail else "cut off")


async def client_that_vanishes(t: Target) -> str | None:
    """Reads one event of a long stream, then closes the connection."""
    async with (
        httpx.AsyncClient(base_url=t.http_url, timeout=120) as http,
        http.stream(
            "POST", "/v1/completions", json=_completion(max_tokens=500, ignore_eos=True, stream=True)
        ) as r,
    ):
        await anext(r.aiter_lines())
    return None


async def non_streaming_client_that_leaves(t: Target) -> str | None:
    async with httpx.AsyncClient(base_url=t.http_url, timeout=120) as http:
        task = asyncio.create_task(
            http.post("/v1/completions", json=_completion(max_tokens=500, ignore_eos=True))
        )
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return None


KINDS: dict[str, Kind] = {
    f.__name__: f
    for f in (
        out_of_vocabulary_stop_id,
        every_token_a_stop_id,
        huge_batch,
        stop_string_flood,
        one_long_stop_string,
        logit_bias_flood,
        megabyte_of_tools,
        many_empty_messages,
        big_tokenize,
        made_up_policy,
        unknown_fields_with_newlines,
        oversized_body,
        oversized_chunked_body,
        shared_request_id,
        reader_that_stops,
        client_that_vanishes,
        non_streaming_client_that_leaves,
    )
}


@dataclass
class HostileLog:
    """What the hostile clients sent and got: per kind, answers as expected and surprises."""

    sent: Counter = field(default_factory=Counter)
    surprises: Counter = field(default_factory=Counter)
    seen: Counter = field(default_factory=Counter)  # "kind: what" for the kinds with several answers
    examples: list[dict] = field(default_factory=list)  # the first few surprises, in full

    def report(self) -> dict:
        return {
            "sent": dict(self.sent),
            "surprises": dict(self.surprises),
            "seen": dict(self.seen),
            "total_sent": sum(self.sent.values()),
            "total_surprises": sum(self.surprises.values()),
            "examples": self.examples,
        }


async def hostile_client(
    target: Target, stop: asyncio.Event, log: HostileLog, rng: random.Random, pause_s: float
) -> None:
    """Every kind in turn (shuffled), one at a time, until ``stop``."""
    kinds = list(KINDS)
    while not stop.is_set():
        rng.shuffle(kinds)
        for name in kinds:
            if stop.is_set():
                return
            try:
                surprise = await KINDS[name](target)
            except Exception as exc:  # a client-side failure is a surprise too: say which
                surprise = f"{type(exc).__name__}: {exc}"
            log.sent[name] += 1
            if isinstance(surprise, Seen):
                log.seen[f"{name}: {surprise.what}"] += 1
            elif surprise is not None:
                log.surprises[name] += 1
                if len(log.examples) < 20:
                    log.examples.append({"kind": name, "got": surprise})
            await asyncio.sleep(pause_s)


def run_hostile(
    target: Target, clients: int, seconds: float, seed: int, idle: int = 0, slowloris: int = 0
) -> dict:
    """``clients`` hostile clients and ``idle`` + ``slowloris`` held-open connections
    (``held_open.py``) for ``seconds`` (and what the clients have under way then), in this
    process: the soak runs it in a process of its own, so the megabytes these clients build
    and read are not counted in the router's memory. Returns the log's report, with the
    held-open connections' under ``held_open``."""

    async def main() -> dict:
        log, held, stop = HostileLog(), HeldLog(), asyncio.Event()
        tasks = [
            asyncio.create_task(hostile_client(target, stop, log, random.Random(seed + i), pause_s=0.5))
            for i in range(clients)
        ]
        tasks += hold_open(target.http_url, idle, slowloris, stop, held)
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        return log.report() | {"held_open": held.report(), "held_longest_s": round(held.longest_lived_s(), 2)}

    return asyncio.run(main())
