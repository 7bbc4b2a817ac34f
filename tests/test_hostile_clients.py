"""One request, one client never hurts the others: a request that fails on its replica fails
alone (not retried, no replica cooled down), and a replica whose engine broke says so and
leaves the index; every count and size a client controls is
bounded on the router and on each replica alike (400 / INVALID_ARGUMENT naming the field); a
batch is admitted as its number of prompts before anything is built for it, and every route
takes a slot; a client that stops reading or vanishes gives its slot and KV blocks back; a
client's request id is echoed but is never a key another client can hit; what a client
names never becomes a metric label or a log line of its choosing."""

import asyncio
import collections
import json
import logging
import socket
import threading
import time

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import eventually, live_replicas_are, local_router_config
from reference import prompts_of_lengths
from tcp_proxy import FreezableProxy

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine import sampler as sampler_module
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica import backend as backend_module
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.config import RouterLimits
from kvmesh.router.policies import POLICIES
from kvmesh.router.process import RouterServer
from kvmesh.serving.connections import ConnectionLimits
from kvmesh.serving.errors import ServingError
from kvmesh.serving.limits import InputLimits
from kvmesh.serving.metrics import read_samples
from kvmesh.serving.openai import protocol as openai_protocol
from kvmesh.serving.openai.responses import ResponseBuilder

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]

INPUTS = InputLimits(
    max_batch_prompts=8,
    max_choices=16,
    max_messages=16,
    max_stop_strings=4,
    max_stop_chars=32,
    max_stop_token_ids=8,
    max_logit_bias=8,
    max_template_bytes=2048,
)
# Quick to give up on a client that does not read or answer pings (seconds).
CONNECTIONS = ConnectionLimits(
    stream_write_timeout_s=1.0, grpc_max_streams=4, grpc_keepalive_s=1.0, grpc_keepalive_timeout_s=1.0
)
MAX_INFLIGHT = 6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(qwen3_dir):
    redis = EmbeddedRedis().start()
    replicas = []
    for i in range(2):
        r = ReplicaServer(
            ReplicaConfig(
                str(qwen3_dir),
                f"hostile-{i}",
                redis.url,
                heartbeat_s=0.2,
                # These replicas share the router's process, whose hostile bodies hold the GIL
                # for a second or more under the full suite's load: their liveness is not this
                # file's subject (the default 3 s TTL lapsed here).
                ttl_s=10.0,
                inputs=INPUTS,
                connections=CONNECTIONS,
                engine=EngineConfig(num_kv_blocks=1024, max_num_batched_tokens=4096),
            )
        )
        await r.start()
        replicas.append(r)
    limits = RouterLimits(max_inflight=MAX_INFLIGHT, inputs=INPUTS)
    router = RouterServer(local_router_config(qwen3_dir, redis.url, limits=limits, connections=CONNECTIONS))
    await router.start()
    await eventually(lambda: live_replicas_are(router, 2))
    yield router, replicas
    await router.stop(grace=0.5)
    for r in replicas:
        await r.stop(grace=0.5)
    redis.close()


def urls(stack) -> dict[str, str]:
    router, replicas = stack
    return {"router": f"http://127.0.0.1:{router.http_port}", "replica": replicas[0].http_address}


def grpc_targets(stack) -> dict[str, tuple[str, type]]:
    router, replicas = stack
    return {
        "router": (router.address, pb_grpc.RouterStub),
        "replica": (replicas[0].address, pb_grpc.ReplicaStub),
    }


# A connection of its own per client, as separate clients have (channels in one process share
# one connection by default, and CONNECTIONS allows 4 streams on one).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


async def generate(address: str, stub_class, request: pb.GenerateRequest, timeout: float = 60, **kw) -> list:
    async with grpc.aio.insecure_channel(address, OWN_CONNECTION) as channel:
        return [r async for r in stub_class(channel).Generate(request, timeout=timeout, **kw)]


async def grpc_code(address, stub_class, request) -> tuple[str, str]:
    try:
        await generate(address, stub_class, request)
        return "OK", ""
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details()


async def read_all(call) -> list:
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def ordinary(salt: int, max_tokens: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompts_of_lengths([40], salt=salt)[0]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


def no_replica_cooled(router) -> bool:
    return all(e.failed_until == 0 for e in router.registry.entries.values())


async def idle(stack) -> bool:
    router, replicas = stack
    engines = [r.engine for r in replicas]
    return router.core.active == 0 and all(
        e.num_streams() == 0 and e.stats().kv.num_used_blocks == 0 for e in engines
    )


# ---------------------------------------------------------------- bad ids, bounds


async def test_an_out_of_vocabulary_stop_id_is_refused_and_hurts_nobody(stack):
    """Unchecked, ``stop_token_ids: [4294967295]`` with ``min_tokens`` indexed past the logits
    row: the step failed for every request beside it, the router retried it on the other
    replica (failing that batch too) and cooled both down: one request took the fleet out."""
    router, _ = stack
    bad = ordinary(1)
    bad.sampling.stop_token_ids.append(2**32 - 1)
    bad.sampling.min_tokens = 1
    ordinary_runs = [
        asyncio.create_task(generate(router.address, pb_grpc.RouterStub, ordinary(10 + i, 30)))
        for i in range(4)
    ]
    for where, (address, stub) in grpc_targets(stack).items():
        code, details = await grpc_code(address, stub, bad)
        assert code == "INVALID_ARGUMENT" and details.startswith("stop_token_ids: token id 4294967295"), where
    for where, url in urls(stack).items():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"prompt": [5, 6, 7], "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [2**32 - 1]}
            reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "stop_token_ids", where
    results = await asyncio.gather(*ordinary_runs)
    assert all(r[-1].complete.usage.completion_tokens == 30 for r in results)
    assert no_replica_cooled(router) and router.health()["status"] == "ok"


HTTP_OVER_BOUNDS = [
    ("completions", {"prompt": [[5, 6]] * 9}, "prompt"),
    ("completions", {"prompt": [[5, 6]] * 4, "n": 5}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * 17}, "messages"),
    ("completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"prompt": "hi", "stop": ["x" * 33]}, "stop"),
    ("completions", {"prompt": "hi", "stop_token_ids": list(range(3, 12))}, "stop_token_ids"),
    ("completions", {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(3, 12)}}, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"d": "x" * 2100}]}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "documents": [{"d": "x" * 2100}]}, "tools"),
    ("completions", {"prompt": "hi", "user": "u" * 300}, "user"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "user": "u" * 300}, "user"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), HTTP_OVER_BOUNDS)
@pytest.mark.parametrize("where", ["router", "replica"])
async def test_every_client_controlled_count_is_bounded_on_every_server(stack, where, endpoint, body, param):
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    async with httpx.AsyncClient(base_url=urls(stack)[where], timeout=60) as http:
        reply = await http.post(path, json={"max_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "the limit is" in error["message"] and "--max-" in error["message"]


@pytest.mark.parametrize("where", ["router", "replica"])
async def test_grpc_requests_are_bounded_the_same_way(stack, where):
    address, stub = grpc_targets(stack)[where]
    too_many_stops = ordinary(2)
    too_many_stops.sampling.stop.extend(["a", "b", "c", "d", "e"])
    chat = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=2))
    for _ in range(17):
        chat.chat.messages.append(pb.ChatMessage(role="user", content="hi"))
    big_bias = ordinary(3)
    big_bias.sampling.logit_bias.update({t: 1.0 for t in range(3, 12)})
    long_id = ordinary(4)
    long_id.request_id = "x" * 300  # echoed in every response: a long one would multiply the stream
    long_key = ordinary(5)
    long_key.affinity_key = "k" * 300
    for request, field in (
        (too_many_stops, "stop"),
        (chat, "messages"),
        (big_bias, "logit_bias"),
        (long_id, "request_id"),
        (long_key, "affinity_key"),
    ):
        code, details = await grpc_code(address, stub, request)
        assert code == "INVALID_ARGUMENT" and details.startswith(f"{field}: "), details


@pytest.mark.parametrize("where", ["router", "replica"])
async def test_a_session_header_is_bounded_and_wins_over_user(stack, where):
    """The x-session-id header is the session key when given (a long ``user`` beside it is
    not used, so not refused: streamed through a relaying router included)."""
    body = {"prompt": "hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=urls(stack)[where], timeout=60) as http:
        long = await http.post("/v1/completions", json=body, headers={"x-session-id": "k" * 300})
        wins = [
            await http.post(
                "/v1/completions",
                json={**body, "user": "u" * 300, "stream": stream},
                headers={"x-session-id": "conv-1"},
            )
            for stream in (False, True)
        ]
    error = long.json()["error"]
    assert long.status_code == 400 and error["param"] == "x-session-id"
    assert error["message"] == "x-session-id: 300 bytes, the limit is 256 (--max-session-key-bytes)"
    assert [r.status_code for r in wins] == [200, 200] and "error" not in wins[1].text


async def test_the_session_policy_is_gone_and_the_known_ones_are_named(stack):
    """``session`` became the prefix policy's hint: asking for it is an unknown policy."""
    router, _ = stack
    known = f"known: {', '.join(sorted(POLICIES))}"
    assert "session" not in POLICIES and "prefix" in known
    request = ordinary(6)
    request.policy = "session"
    code, details = await grpc_code(router.address, pb_grpc.RouterStub, request)
    assert code == "INVALID_ARGUMENT" and details == f"unknown policy 'session'; {known}"
    async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
        reply = await http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "policy": "session"}
        )
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "policy"
    assert error["message"] == f"unknown policy 'session'; {known}"


# ---------------------------------------------------------------- admission before allocation


async def test_a_batch_is_admitted_as_its_prompts_before_anything_is_built(stack):
    _, replicas = stack
    prompts_before = [r.engine.stats().prompt_tokens for r in replicas]
    async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
        bounded = await http.post("/v1/completions", json={"prompt": [[5, 6, 7]] * 9, "max_tokens": 2})
        over = await http.post("/v1/completions", json={"prompt": [[5, 6, 7]] * 7, "max_tokens": 2})
        # one long stream in flight: a batch of MAX_INFLIGHT no longer fits whole
        body = {
            "prompt": prompts_of_lengths([20], salt=9)[0],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.stream("POST", "/v1/completions", json=body) as running:
            await anext(running.aiter_lines())
            full = await http.post(
                "/v1/completions", json={"prompt": [[5, 6, 7]] * MAX_INFLIGHT, "max_tokens": 2}
            )
    assert bounded.status_code == 400 and bounded.json()["error"]["param"] == "prompt"  # 9 > the bound
    assert over.status_code == 429 and "this one counts 7" in over.json()["error"]["message"]
    assert full.status_code == 429 and "this one counts 6" in full.json()["error"]["message"]
    await eventually(lambda: idle(stack))
    grew = [r.engine.stats().prompt_tokens - b for r, b in zip(replicas, prompts_before, strict=True)]
    assert sum(grew) == 20  # only the one stream ran: nothing of the refused batches reached a replica


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "hello"}),
        ("/detokenize", {"tokens": [5, 6]}),
        ("/v1/completions/render", {"prompt": "hello"}),
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_every_route_takes_a_slot(stack, path, body):
    router, _ = stack
    held = router.core.admit(MAX_INFLIGHT)  # the router is full
    try:
        async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
            refused = await http.post(path, json=body)
    finally:
        held.release()
    async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
        served = await http.post(path, json=body)
    assert refused.status_code == 429 and served.status_code == 200, served.text


async def test_a_huge_batch_body_is_refused_by_count(stack):
    """~600k one-token prompts fit in a 4 MiB body: counted (parsed off the loop) and
    refused before one GenerateRequest is built."""
    router, _ = stack
    data = json.dumps({"prompt": [[5]] * 600_000, "max_tokens": 1}).encode()
    assert len(data) < 4 << 20
    async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
        reply = await http.post("/v1/completions", content=data, headers={"content-type": "application/json"})
        health = await http.get("/health")
    assert reply.status_code == 400 and "600000 prompts" in reply.json()["error"]["message"]
    assert health.status_code == 200 and router.core.active == 0


async def test_a_chunked_body_over_the_limit_is_413(stack):
    async def chunks():
        for _ in range(80):
            yield b"x" * (64 << 10)  # 5 MiB, no content-length

    async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
        reply = await http.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert reply.status_code == 413 and reply.json()["error"]["code"] == 413


# ---------------------------------------------------------------- slow and vanished clients


def big_echo_body(stream: bool) -> dict:
    """A request whose answer is megabytes (each prompt token with its 20 likeliest others,
    for each of 8 choices) and that then keeps generating: a client that does not read it
    fills every buffer between it and the server."""
    return {
        "prompt": prompts_of_lengths([1500], salt=4)[0],
        "echo": True,
        "logprobs": 20,
        "n": 8,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": stream,
    }


async def test_an_http_client_that_stops_reading_is_cut_off_and_frees_everything(stack):
    router, replicas = stack
    port = router.http_port
    payload = json.dumps(big_echo_body(stream=True)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)  # and never read a byte
    try:
        assert await eventually(lambda: asyncio.sleep(0, result=router.core.active == 1), timeout=10)
        started = time.monotonic()
        assert await eventually(lambda: idle(stack), timeout=30)  # slot, streams and blocks all back
        generated = sum(r.engine.stats().generation_tokens for r in replicas)
        assert time.monotonic() - started < 25 and generated < 8 * 2000  # aborted, not run to the end
    finally:
        sock.close()


def recording_threads(fn, threads: list[tuple[str, bool]], large):
    """``fn`` wrapped to record, per call, its thread's name and whether ``large(*args)``."""

    def wrapper(*args):
        threads.append((threading.current_thread().name, large(*args)))
        return fn(*args)

    return wrapper


@pytest.mark.parametrize("stream", [False, True])
async def test_a_megabyte_of_log_probabilities_is_built_off_the_event_loop(stack, stream, monkeypatch):
    """Naming 8 x 1,500 prompt tokens' 20 alternatives once held the router's loop (and, in
    one process, the replicas' heartbeats) for seconds: the replica builds such a chunk, and
    the router its OpenAI events or body, in a thread; a token's own chunk stays inline."""
    built, shown = [], []
    monkeypatch.setattr(
        backend_module,
        "_chunk",
        recording_threads(backend_module._chunk, built, lambda out, *_: bool(out.prompt_logprobs)),
    )
    monkeypatch.setattr(
        ResponseBuilder,
        "add",
        recording_threads(ResponseBuilder.add, shown, lambda _, __, r: bool(r.chunk.prompt_logprobs)),
    )
    body = {**big_echo_body(stream), "max_tokens": 4}
    async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
        reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        choices = [c for e in events for c in e["choices"] if c["logprobs"]]
    else:
        choices = reply.json()["choices"]
    named = collections.Counter()
    for c in choices:
        named[c["index"]] += len(c["logprobs"]["top_logprobs"])
    assert named == {i: 1500 + 4 for i in range(8)}  # each choice's prompt, then its tokens
    for threads in built, shown:
        assert sorted(large for _, large in threads).count(True) == 8  # one per choice
        assert all(name.startswith("kvmesh-offload") == large for name, large in threads), threads


async def test_a_grpc_client_that_stops_reading_is_cut_off(stack):
    router, _ = stack
    proxy = FreezableProxy(int(router.address.rsplit(":", 1)[1]))
    port = await proxy.start()
    request = ordinary(5, max_tokens=2000)
    request.token_ids.ids[:] = prompts_of_lengths([1500], salt=5)[0]
    request.sampling.prompt_logprobs = 20
    request.sampling.n = 8
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.RouterStub(channel).Generate(request, timeout=120)
        await call.read()
        proxy.freeze("down")  # the client reads no more
        assert await eventually(lambda: idle(stack), timeout=40)
        call.cancel()
    await proxy.close()


async def test_a_non_streaming_request_stops_when_its_client_leaves(stack):
    router, replicas = stack
    before = sum(r.engine.stats().generation_tokens for r in replicas)
    body = {"prompt": prompts_of_lengths([30], salt=6)[0], "max_tokens": 3000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
        task = asyncio.create_task(http.post("/v1/completions", json=body))
        assert await eventually(lambda: asyncio.sleep(0, result=router.core.active == 1), timeout=10)
        await asyncio.sleep(0.3)
        task.cancel()  # the client closes its connection
    assert await eventually(lambda: idle(stack), timeout=10)
    generated = sum(r.engine.stats().generation_tokens for r in replicas) - before
    assert generated < 3000  # it stopped: nobody waited for the rest


async def test_a_vanished_grpc_client_is_dropped_by_keepalive(stack):
    """A client behind a partition sends no FIN: only the server's unanswered pings tell, within
    one ping interval and its timeout (1 + 1 s here). The write timeout alone would take far
    longer: gRPC's flow-control window and the socket buffers take ~2,500 tokens (13 s on this
    machine) before a write blocks, and that was the only way out while gRPC's own 60 s ping
    timeout overrode the keepalive timeout."""
    router, _ = stack
    proxy = FreezableProxy(int(router.address.rsplit(":", 1)[1]))
    port = await proxy.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.RouterStub(channel).Generate(ordinary(7, max_tokens=3000), timeout=120)
        await call.read()
        proxy.freeze("both")
        assert await eventually(lambda: idle(stack), timeout=8)
        call.cancel()
    await proxy.close()


async def test_one_connection_carries_a_bounded_number_of_streams(stack):
    router, _ = stack
    peak = 0
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = pb_grpc.RouterStub(channel)

        async def one(i):
            try:
                return [r async for r in stub.Generate(ordinary(20 + i, max_tokens=60), timeout=60)]
            except grpc.aio.AioRpcError as err:
                # A stream opened as another ended can cross the server's count of it and be
                # refused (RST_STREAM REFUSED_STREAM, never processed): UNAVAILABLE, retry.
                if err.code() != grpc.StatusCode.UNAVAILABLE or "RST_STREAM" not in (err.details() or ""):
                    raise
                return [r async for r in stub.Generate(ordinary(20 + i, max_tokens=60), timeout=60)]

        await one(19)  # the connection is up and the client knows the server's stream bound
        calls = asyncio.gather(*(one(i) for i in range(6)))
        while not calls.done():
            peak = max(peak, router.core.active)
            await asyncio.sleep(0.005)
        results = await calls
    assert all(r[-1].complete.usage.completion_tokens == 60 for r in results)
    assert peak == CONNECTIONS.grpc_max_streams  # the other two waited for a stream, not a slot


@pytest.mark.parametrize("where", ["router", "replica"])
@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\x0a\xff", "the protobuf encoding is corrupt"),
        (
            pb.GenerateRequest(model="ab").SerializeToString().replace(b"ab", b"\xff\xfe"),
            "field model is not",
        ),
    ],
)
async def test_a_request_that_does_not_decode_is_invalid_argument(stack, where, data, reason):
    address, stub_class = grpc_targets(stack)[where]
    method = f"/kvmesh.v1.{stub_class.__name__.removesuffix('Stub')}/Generate"
    async with grpc.aio.insecure_channel(address, OWN_CONNECTION) as channel:
        call = channel.unary_stream(method, request_serializer=lambda b: b)(data, timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read_all(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in caught.value.details()


HUGE_NAME = "m" * (1 << 20)


@pytest.mark.parametrize("where", ["router", "replica"])
async def test_a_huge_model_name_is_not_echoed_back(stack, where):
    async with httpx.AsyncClient(base_url=urls(stack)[where], timeout=60) as http:
        reply = await http.post("/v1/completions", json={"model": HUGE_NAME, "prompt": "hi", "max_tokens": 1})
    assert reply.status_code == 404 and len(reply.content) < 1024, reply.content[:200]
    message = reply.json()["error"]["message"]
    assert message.startswith("model 'mmm") and f"{1 << 20} characters" in message
    address, stub_class = grpc_targets(stack)[where]
    code, details = await grpc_code(address, stub_class, pb.GenerateRequest(text="hi", model=HUGE_NAME))
    assert code == "NOT_FOUND" and details.startswith("model ") and len(details) < 1024, details[:200]


# ---------------------------------------------------------------- ids, labels, log lines


@pytest.mark.parametrize("where", ["router", "replica"])
async def test_request_ids_are_echoed_and_never_shared_between_clients(stack, where):
    address, stub_class = grpc_targets(stack)[where]
    mine, theirs = ordinary(30, max_tokens=300), ordinary(31, max_tokens=300)
    mine.request_id = theirs.request_id = "same-id"
    async with (
        grpc.aio.insecure_channel(address, OWN_CONNECTION) as a,
        grpc.aio.insecure_channel(address, OWN_CONNECTION) as b,
    ):
        call_a = stub_class(a).Generate(mine, timeout=60)
        call_b = stub_class(b).Generate(theirs, timeout=60)
        assert (await call_a.read()).request_id == "same-id" and (await call_b.read()).request_id == "same-id"
        # B's Abort by that id reaches B's own request, never A's
        assert (await stub_class(b).Abort(pb.AbortRequest(request_id="same-id"))).found
        rest_a, rest_b = await read_all(call_a), await read_all(call_b)
    assert (
        rest_a[-1].complete.finish_reason == "length" and rest_a[-1].complete.usage.completion_tokens == 300
    )
    assert rest_b[-1].complete.finish_reason == "abort"


async def test_made_up_policy_names_never_become_label_values(stack):
    router, _ = stack
    held = router.core.admit(MAX_INFLIGHT)  # full: the overload counter sees every request
    try:
        for i in range(20):
            request = ordinary(40 + i)
            request.policy = f"made-up-{i}"
            code, _ = await grpc_code(router.address, pb_grpc.RouterStub, request)
            assert code == "RESOURCE_EXHAUSTED"
    finally:
        held.release()
    policies = {
        dict(labels).get("policy") for (name, labels) in read_samples(router.core.render_metrics().decode())
    }
    assert "unknown" in policies and not any(p and p.startswith("made-up") for p in policies)


async def test_unknown_field_names_are_bounded_and_never_logged_raw(stack, caplog):
    openai_protocol._seen_unknown.clear()
    try:
        async with httpx.AsyncClient(base_url=urls(stack)["router"], timeout=60) as http:
            with caplog.at_level(logging.WARNING, logger="kvmesh.serving.openai.protocol"):
                for i in range(100):
                    forged = {f"f{i}": 1, f"x{i}\nERROR forged line": 1}
                    body = {"prompt": [5, 6], "max_tokens": 1, **forged}
                    assert (await http.post("/v1/completions", json=body)).status_code == 200
        assert len(openai_protocol._seen_unknown) <= openai_protocol.MAX_UNKNOWN_FIELDS
    finally:
        openai_protocol._seen_unknown.clear()  # the process's memory of names: other tests' names too
    fields = [r.field for r in caplog.records if hasattr(r, "field")]
    assert len(fields) <= openai_protocol.MAX_UNKNOWN_FIELDS and not any("\n" in f for f in fields)


# ---------------------------------------------------------------- failures that stay their own


async def test_a_request_that_fails_on_its_replica_fails_alone_through_the_router(stack, monkeypatch):
    """Fault injection: one request's sampling raises on whichever replica runs it. It ends
    INTERNAL, is not moved to another replica (it would fail there too), and no replica is
    cooled down; the requests beside it finish."""
    router, replicas = stack
    real_adjust = sampler_module.row_adjustments

    def adjust_or_raise(request, *args):
        if request.params.logit_bias == {11: 0.25}:
            raise RuntimeError("injected sampling fault")
        return real_adjust(request, *args)

    monkeypatch.setattr(sampler_module, "row_adjustments", adjust_or_raise)
    failed_before = sum(r.engine.stats().num_failed_requests for r in replicas)
    bad = ordinary(50, max_tokens=20)
    bad.sampling.logit_bias[11] = 0.25
    runs = [generate(router.address, pb_grpc.RouterStub, ordinary(60 + i, 30)) for i in range(4)]
    (code, details), *results = await asyncio.gather(
        grpc_code(router.address, pb_grpc.RouterStub, bad), *runs
    )
    assert code == "INTERNAL" and "injected sampling fault" in details
    assert all(r[-1].complete.usage.completion_tokens == 30 for r in results)
    assert sum(r.engine.stats().num_failed_requests for r in replicas) - failed_before == 1  # not retried
    assert no_replica_cooled(router) and router.health()["status"] == "ok"


async def test_a_call_its_replica_cancelled_moves_to_another_replica(stack, monkeypatch):
    """Fault injection: the first replica a request reaches ends it CANCELLED before any
    response, as gRPC does to a call that reaches a server in the instant it stops. The
    router did not cancel it, so it reads as the replica going away (UNAVAILABLE): the request
    moves to the other replica and its client never sees a CANCELLED it did not cause."""
    router, replicas = stack
    hit = []

    class Cancelled(ServingError):
        grpc_code = grpc.StatusCode.CANCELLED

    def failovers() -> float:
        return read_samples(router.core.render_metrics().decode())[("kvmesh_router_failovers_total", ())]

    def cancelled_once(backend):
        real_admit = backend.admit

        def admit(count=1, policy=""):
            if not hit:
                hit.append(backend.replica_id)
                raise Cancelled("injected: the server stopped under the call")
            return real_admit(count, policy)

        return admit

    for r in replicas:
        monkeypatch.setattr(r.backend, "admit", cancelled_once(r.backend))
    failovers_before = failovers()
    responses = await generate(router.address, pb_grpc.RouterStub, ordinary(70, max_tokens=5))
    done = responses[-1].complete
    assert done.usage.completion_tokens == 5 and hit and done.replica_id != hit[0]
    assert failovers() == failovers_before + 1
    router.registry.entries[hit[0]].failed_until = 0  # the cool-down it earned ends with this test


async def test_a_replica_whose_engine_broke_says_so_and_leaves_the_index(stack, qwen3_dir, monkeypatch):
    router, replicas = stack
    broken = ReplicaServer(
        ReplicaConfig(str(qwen3_dir), "hostile-broken", replicas[0].config.redis_url, heartbeat_s=0.2)
    )
    await broken.start()
    try:
        assert await eventually(lambda: live_replicas_are(router, 3))

        def fail(*args):
            raise RuntimeError("injected device failure")

        monkeypatch.setattr(broken.engine.engine.runner, "_forward_layout", fail)
        for i in range(3):  # three failed steps in a row
            code, _ = await grpc_code(broken.address, pb_grpc.ReplicaStub, ordinary(70 + i))
            assert code == "UNAVAILABLE"
        assert await eventually(lambda: live_replicas_are(router, 2), timeout=10)  # gone from the index
        async with httpx.AsyncClient(base_url=broken.http_address) as http:
            health = await http.get("/health")
        assert health.status_code == 503 and "engine broken" in health.json()["reason"]
        async with grpc.aio.insecure_channel(broken.address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            status = await check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Replica"))
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        results = await asyncio.gather(
            *(generate(router.address, pb_grpc.RouterStub, ordinary(80 + i)) for i in range(6))
        )
        assert all(r[-1].complete.replica_id != "hostile-broken" for r in results)
    finally:
        await broken.stop(grace=0.5)
