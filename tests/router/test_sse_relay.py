"""A streamed HTTP request goes from the router to its replica's own OpenAI port and back
byte for byte (``router/replica_http.py``, ``serving/openai/relay.py``): the client gets
what the replica wrote, without the trailer the replica adds for the router; the router still
accounts for every request (cached tokens, prediction checks); a replica that cannot take it moves
the request once, one that fails midway ends it in band; a client that leaves frees its
replica's work. Real replicas, a real router, real sockets; a hand-written upstream only to
inject the faults a real replica does not make on purpose."""

import asyncio
import base64
import contextlib
import dataclasses
import json

import grpc
import httpx
import pytest
import pytest_asyncio
from fake_http import FakeHttpServer
from helpers import eventually, local_router_config, metric, started_router

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.flow import FlowConfig
from kvmesh.router.process import RouterServer
from kvmesh.router.replica_http import ReplicaHttp, _Connection
from kvmesh.serving.errors import InvalidRequest
from kvmesh.serving.openai.relay import (
    RELAY_PATHS,
    failure_line,
    packed_token_ids,
    take_token_lines,
    take_trailer,
    token_line,
    trailer,
    unpacked_token_ids,
    whole_events,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]

PROMPT = "relay me the same bytes, the quick brown fox jumps over the lazy dog " * 3


# ---------------------------------------------------------------------- the wire format


async def test_events_are_cut_whole_and_the_trailer_is_taken_out_at_an_event_start_only():
    complete = pb.Complete(replica_id="r0", usage=pb.Usage(prompt_tokens=40, cached_tokens=32), incarnation=7)
    text_like_trailer = json.dumps({"text": "\n\n: kvmesh-complete AAAA"})  # what a model might write
    stream = (
        f"data: {text_like_trailer}\n\n" + 'data: {"a": 1}\n\n' + trailer(complete) + "data: [DONE]\n\n"
    ).encode()
    cuts = [stream[:7], stream[7:50], stream[50:51], stream[51:120], stream[120:]]  # across events
    blocks, carry = [], b""
    for data in cuts:
        block, carry = whole_events(carry + data)
        blocks += [block] if block else []
    assert b"".join(blocks) == stream and all(b.endswith(b"\n\n") for b in blocks)
    kept, found = [], []
    for block in blocks:
        block, got = take_trailer(block)
        kept.append(block)
        found += [got] if got is not None else []
    assert found == [complete]
    assert b"".join(kept) == stream.replace(trailer(complete).encode(), b"")
    assert text_like_trailer.encode() in b"".join(kept)  # a data event's text is never taken


async def test_token_ids_travel_packed_and_come_back_exactly():
    ids = [0, 1, 151_643, 2**31, 2**32 - 1]
    packed = packed_token_ids(ids)
    assert unpacked_token_ids(packed.decode()) == ids
    assert len(base64.b64decode(packed)) == 4 * len(ids)
    for bad in ("not base64!", "AAA=", packed.decode()[:-4] + "AQ=="):  # not base64, 2 bytes, 21 bytes
        with pytest.raises(InvalidRequest, match="prompt_token_ids"):
            unpacked_token_ids(bad)


async def test_token_lines_are_taken_out_and_an_event_without_one_makes_the_ids_unknown():
    marked = (token_line([5, 6]) + 'data: {"a": 1}\n\n' + token_line([]) + "data: [DONE]\n\n").encode()
    block, ids = take_token_lines(marked)
    assert block == b'data: {"a": 1}\n\ndata: [DONE]\n\n' and ids == [5, 6]
    assert take_token_lines(b'data: {"b": 2}\n\n' + marked)[1] is None  # what that event showed is unknown
    assert take_token_lines(b": keep-alive\n\n") == (b": keep-alive\n\n", [])


# ---------------------------------------------------------------------- through the router


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(qwen3_dir):
    redis = EmbeddedRedis().start()
    engine = EngineConfig(num_kv_blocks=256, block_size=16, max_model_len=1024)
    replicas = [
        ReplicaServer(ReplicaConfig(str(qwen3_dir), f"relay-{i}", redis.url, engine=engine)) for i in range(2)
    ]
    for replica in replicas:
        await replica.start()
    router = await started_router(RouterServer(local_router_config(qwen3_dir, redis.url)))
    assert await eventually(lambda: asyncio.sleep(0, result=len(router.registry.live()) == 2))
    async with httpx.AsyncClient(timeout=30) as client:
        yield {
            "redis": redis,
            "router": router,
            "replicas": replicas,
            "client": client,
            "url": f"http://127.0.0.1:{router.http_port}",
        }
    await router.stop(grace=0.5)
    for replica in replicas:
        await replica.stop(grace=0.5)
    redis.close()


async def _stream(client: httpx.AsyncClient, url: str, **fields) -> list[bytes]:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True, **fields}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        return [line async for line in response.aiter_bytes()]


def _events(raw: bytes) -> list[dict | str]:
    out = []
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: "):
            data = event[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_the_client_gets_the_replicas_own_stream_and_the_router_still_accounts_for_it(fleet):
    router, client = fleet["router"], fleet["client"]
    relayed = metric(router.core, "kvmesh_router_relayed_streams_total")
    cached = metric(router.core, "kvmesh_router_actual_cached_tokens_total")
    prompt_tokens = metric(router.core, "kvmesh_router_prompt_tokens_total")
    options = {"stream_options": {"include_usage": True}}
    first = b"".join(await _stream(client, fleet["url"], **options))
    second = b"".join(await _stream(client, fleet["url"], **options))
    assert b"kvmesh-complete" not in first + second  # the router's trailer never reaches a client
    events = _events(second)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # the second found the first's prefix
    assert metric(router.core, "kvmesh_router_relayed_streams_total") == relayed + 2
    # The router read each stream's Complete from the trailer: its counters match what the
    # client was told, request for request.
    first_usage = _events(first)[-2]["usage"]
    assert metric(router.core, "kvmesh_router_prompt_tokens_total") - prompt_tokens == (
        first_usage["prompt_tokens"] + usage["prompt_tokens"]
    )
    assert metric(router.core, "kvmesh_router_actual_cached_tokens_total") - cached == (
        first_usage["prompt_tokens_details"]["cached_tokens"]
        + usage["prompt_tokens_details"]["cached_tokens"]
    )


async def test_the_relayed_stream_matches_a_direct_one(fleet):
    router, client = fleet["router"], fleet["client"]
    fields = {
        "logprobs": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    via_router = _events(b"".join(await _stream(client, fleet["url"], **fields)))
    direct_url = fleet["replicas"][0].http_address
    direct = _events(b"".join(await _stream(client, direct_url, **fields)))

    def shape(events):  # ids, clocks and how much of the prompt each found cached aside
        for event in events:
            if isinstance(event, dict) and "prompt_tokens_details" in event.get("usage", {}):
                del event["usage"]["prompt_tokens_details"]
        return [
            e
            if isinstance(e, str)
            else _rounded({k: v for k, v in e.items() if k not in ("id", "created", "model")})
            for e in events
        ]

    assert shape(via_router) == shape(direct)
    assert {e["model"] for e in via_router if isinstance(e, dict)} == {router.core.model.api_name}


async def test_the_stream_is_spliced_into_the_client_connection(fleet, monkeypatch):
    """After its first event, a relayed stream's events go from the replica's connection to
    the client's without the router's reader waking per token: 24 tokens, a handful of reads.
    Only with migration off: a stream that may move is read for its events' token ids."""
    core = fleet["router"].core
    monkeypatch.setattr(core, "limits", dataclasses.replace(core.limits, migration_limit=0))
    reads = []
    real_read = _Connection.read

    async def counted(self):
        data = await real_read(self)
        reads.append(data)
        return data

    monkeypatch.setattr(_Connection, "read", counted)
    options = {"stream_options": {"include_usage": True}}
    events = _events(b"".join(await _stream(fleet["client"], fleet["url"], max_tokens=24, **options)))
    assert events[-2]["usage"]["completion_tokens"] == 24 and events[-1] == "[DONE]"
    assert len([e for e in events if isinstance(e, dict) and e["choices"]]) > 12  # streamed, not one block
    assert len(reads) <= 5, reads  # the first event(s), the trailer and [DONE], the end


def _rounded(value):
    """Log-probabilities to 4 places: a prompt computed anew and one partly read from the
    prefix cache differ in the last float bits."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


async def test_a_replica_whose_port_refuses_moves_the_request_once_and_cools_down(fleet):
    router, client = fleet["router"], fleet["client"]
    # The replica the prompt goes to first: the one that served it (and holds its prefix now),
    # whatever earlier tests left in the caches.
    served = {e.record.replica_id: _decisions(router, e) for e in router.registry.entries.values()}
    await _stream(client, fleet["url"])
    broken = next(
        e for e in router.registry.entries.values() if _decisions(router, e) > served[e.record.replica_id]
    )
    saved = broken.http
    broken.http = ReplicaHttp("http://127.0.0.1:9", None)  # nothing listens on the discard port
    failovers = metric(router.core, "kvmesh_router_failovers_total")
    try:
        for _ in range(4):  # whichever replica the policy picks first, the request is served
            events = _events(b"".join(await _stream(client, fleet["url"])))
            assert events[-1] == "[DONE]" and all("error" not in e for e in events if isinstance(e, dict))
        assert broken.failed_until > 0  # cooled down: the following requests skip it
        assert metric(router.core, "kvmesh_router_failovers_total") >= failovers + 1
    finally:
        broken.http, broken.failed_until = saved, 0.0


def _decisions(router: RouterServer, entry) -> float:
    return metric(router.core, "kvmesh_router_routing_decisions_total", replica=entry.record.replica_id)


class _Upstream(FakeHttpServer):
    """A replica's HTTP port that answers as told: ``status`` with an OpenAI error, or a 200
    that streams ``events`` and then drops the connection (``ends``: ends the answer properly
    instead)."""

    def __init__(self, status: int = 200, events: list[str] = (), ends: bool = False):
        super().__init__()
        self.status, self.events, self.ends = status, list(events), ends

    async def answer(self, writer: asyncio.StreamWriter) -> bool:
        if self.status != 200:
            body = json.dumps({"error": {"message": "prompt: told to refuse", "code": self.status}}).encode()
            writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (self.status, len(body), body))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in self.events:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event.encode()))
            if self.ends:
                writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.transport.abort()  # without ``ends``: a replica that died midway, no last chunk
        return False


async def _with_only(router: RouterServer, upstream_url: str):
    """Every replica's HTTP port pointed at ``upstream_url``; returns what to restore."""
    saved = {rid: e.http for rid, e in router.registry.entries.items()}
    for entry in router.registry.entries.values():
        entry.http = ReplicaHttp(upstream_url, None)
    return saved


def _restore(router: RouterServer, saved: dict) -> None:
    for rid, http in saved.items():
        router.registry.entries[rid].http = http
        router.registry.entries[rid].failed_until = 0.0


async def test_a_replica_failing_midway_ends_the_stream_in_band(fleet):
    router, client = fleet["router"], fleet["client"]
    async with _Upstream(events=['data: {"choices": [{"text": "a"}]}\n\n']) as upstream:
        saved = await _with_only(router, upstream.url)
        try:
            events = _events(b"".join(await _stream(client, fleet["url"])))
        finally:
            _restore(router, saved)
    assert events[0] == {"choices": [{"text": "a"}]}  # what the client had, it keeps
    assert events[1]["error"]["code"] == 503 and "connection to the replica" in events[1]["error"]["message"]
    assert events[-1] == "[DONE]" and upstream.requests == 1  # streamed: never moved


class _FailsThenContinues(FakeHttpServer):
    """A replica's HTTP port whose first answer shows two tokens and then fails the stream in
    band as a replica whose engine died does (UNAVAILABLE); whose second (the moved stream's
    continuation) shows one more token and ends properly."""

    async def answer(self, writer: asyncio.StreamWriter) -> bool:
        if self.requests == 1:
            error = 'data: {"error": {"message": "engine step loop stalled", "code": 503}}\n\n'
            events = [
                token_line([]) + 'data: {"choices": [{"text": ""}]}\n\n',
                token_line([7]) + 'data: {"choices": [{"text": "a"}]}\n\n',
                token_line([8]) + 'data: {"choices": [{"text": "b"}]}\n\n',
                token_line([]) + failure_line("UNAVAILABLE") + error,
                token_line([]) + "data: [DONE]\n\n",
            ]
        else:
            complete = pb.Complete(replica_id="r", usage=pb.Usage(prompt_tokens=40, completion_tokens=3))
            events = [
                token_line([9]) + 'data: {"choices": [{"text": "c"}]}\n\n',
                trailer(complete),
                token_line([]) + "data: [DONE]\n\n",
            ]
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event.encode()))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


async def test_a_stream_its_replica_fails_in_band_moves_with_the_tokens_its_client_saw(fleet):
    """The replica's failure event (UNAVAILABLE, marked for the router) never reaches the
    client: the stream continues on the other replica, whose envelope carries the tokens the
    client saw at the prompt's end and says it is a continuation."""
    router, client = fleet["router"], fleet["client"]
    moved = metric(router.core, "kvmesh_router_migrations_total", outcome="moved")
    async with _FailsThenContinues() as upstream:
        saved = await _with_only(router, upstream.url)
        try:
            events = _events(b"".join(await _stream(client, fleet["url"])))
        finally:
            _restore(router, saved)
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e]
    assert texts == ["", "a", "b", "c"] and events[-1] == "[DONE]", events
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    first, second = (json.loads(b) for b in upstream.bodies)
    assert unpacked_token_ids(second["prompt_token_ids"]) == unpacked_token_ids(first["prompt_token_ids"]) + [
        7,
        8,
    ]
    assert (
        second["continued_tokens"] == 2
        and second["continuation"]
        and second["request_id"] == first["request_id"]
    )
    assert metric(router.core, "kvmesh_router_migrations_total", outcome="moved") == moved + 1


class _CutsSlowReaders(FakeHttpServer):
    """A replica whose write timeout cuts a stream the router stopped reading: it streams
    until a write has waited ``stall_s`` (every buffer between it and the client is full),
    then drops the connection."""

    def __init__(self, stall_s: float = 2.0):
        super().__init__()
        self.stall_s, self.cut = stall_s, asyncio.Event()

    async def answer(self, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b'data: {"choices": [{"text": "%s"}]}\n\n' % (b"x" * 16000)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):  # bounded, should the client read after all
                while True:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await asyncio.wait_for(writer.drain(), self.stall_s)
        writer.transport.abort()
        self.cut.set()
        return False


async def test_a_stream_cut_because_its_client_stopped_reading_does_not_cool_the_replica(fleet):
    router, client = fleet["router"], fleet["client"]
    async with _CutsSlowReaders() as upstream:
        saved = await _with_only(router, upstream.url)
        try:
            body = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
            async with client.stream("POST", fleet["url"] + "/v1/completions", json=body) as response:
                chunks = response.aiter_bytes()
                first = await anext(chunks)
                await asyncio.wait_for(upstream.cut.wait(), 40)  # not reading meanwhile
                raw = first + b"".join([chunk async for chunk in chunks])
            cooled = [rid for rid, e in router.registry.entries.items() if e.failed_until > 0]
        finally:
            _restore(router, saved)
    last = _events(raw)[-2]
    assert last["error"]["code"] == 504 and "did not read the stream" in last["error"]["message"]
    assert cooled == []  # the replica did nothing wrong: later requests still go to it


async def test_a_stream_the_replica_ended_with_an_error_counts_as_failed(fleet):
    router, client = fleet["router"], fleet["client"]
    error = 'data: {"error": {"message": "replica error: out of blocks", "code": 500}}\n\n'
    failed = metric(router.core, "kvmesh_router_requests_total", outcome="error")
    async with _Upstream(events=[error, "data: [DONE]\n\n"], ends=True) as upstream:
        saved = await _with_only(router, upstream.url)
        try:
            events = _events(b"".join(await _stream(client, fleet["url"])))
        finally:
            _restore(router, saved)
    assert events == [
        {"error": {"message": "replica error: out of blocks", "code": 500}},
        "[DONE]",
    ]  # as it was
    assert metric(router.core, "kvmesh_router_requests_total", outcome="error") == failed + 1


async def test_a_replicas_refusal_reaches_the_client_with_its_status_and_message(fleet):
    router, client = fleet["router"], fleet["client"]
    async with _Upstream(status=400) as upstream:
        saved = await _with_only(router, upstream.url)
        try:
            body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
            response = await client.post(fleet["url"] + "/v1/completions", json=body)
        finally:
            _restore(router, saved)
    assert response.status_code == 400 and upstream.requests == 1  # the request's fault: not moved
    error = response.json()["error"]
    assert "told to refuse" in error["message"] and error["param"] == "prompt"


def _aborted(replicas) -> float:
    return sum(metric(r.backend, "kvmesh_replica_requests_total", outcome="cancelled") for r in replicas)


async def test_a_client_that_leaves_midway_frees_its_replicas_work(fleet):
    router, client, replicas = fleet["router"], fleet["client"], fleet["replicas"]
    aborted = _aborted(replicas)
    body = {"prompt": PROMPT, "max_tokens": 800, "ignore_eos": True, "stream": True}
    async with client.stream("POST", fleet["url"] + "/v1/completions", json=body) as response:
        async for _ in response.aiter_bytes():
            break  # one event, then gone

    async def idle() -> bool:
        return router.core.active == 0 and all(
            not r.engine.engine.has_unfinished_requests() for r in replicas
        )

    assert await eventually(idle, timeout=10)
    assert _aborted(replicas) == aborted + 1  # cancelled, not run to its end


async def test_a_malformed_envelope_is_refused_with_400_naming_the_field(fleet):
    replica = fleet["replicas"][0]
    envelope = {
        "model": "m",
        "request_id": "r-bad-ids",
        "prompt_token_ids": "AAA=",
        "request": {"prompt": "x", "max_tokens": 1, "stream": True},
    }
    response = await fleet["client"].post(replica.http_address + RELAY_PATHS["completions"], json=envelope)
    assert response.status_code == 400, response.text
    assert "prompt_token_ids" in response.json()["error"]["message"]


async def test_a_request_queued_past_its_ttl_gets_429_without_reaching_a_replica(fleet, qwen3_dir):
    """Flow control through a real router: a fleet it finds saturated (any queue delay is over
    its limit) keeps requests at the router; past their band's TTL they get 429 with a
    Retry-After (gRPC: RESOURCE_EXHAUSTED), and no replica sees them."""
    flow = FlowConfig(bands="urgent:8:0.3,normal:8:0.3", max_queue_delay_s=1e-9)
    router = await started_router(RouterServer(local_router_config(qwen3_dir, fleet["redis"].url, flow=flow)))
    try:
        sent = [metric(r.backend, "kvmesh_replica_requests_total") for r in fleet["replicas"]]
        body = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
        url = f"http://127.0.0.1:{router.http_port}/v1/completions"
        refused = await fleet["client"].post(url, json=body, headers={"x-kvmesh-priority": "urgent"})
        assert refused.status_code == 429, refused.text
        assert (
            int(refused.headers["retry-after"]) >= 1
            and "priority band urgent" in refused.json()["error"]["message"]
        )
        bad = await fleet["client"].post(url, json=body, headers={"x-kvmesh-priority": "asap"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        async with grpc.aio.insecure_channel(router.address) as channel:
            request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=5))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in pb_grpc.RouterStub(channel).Generate(request, timeout=10):
                    pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "normal" in err.value.details()
        assert [metric(r.backend, "kvmesh_replica_requests_total") for r in fleet["replicas"]] == sent
    finally:
        await router.stop(grace=0.2)
