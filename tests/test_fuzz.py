"""Property-based fuzzing of the front doors: any Generate request and any OpenAI JSON body
gets a result or a clean error code, and the servers stay healthy afterwards."""

import asyncio
import json
import math
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import local_router_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.config import RouterLimits
from kvmesh.router.process import RouterServer

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes

CLEAN_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
CLEAN_HTTP = {200, 400, 404, 413, 429}
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def servers(qwen3_dir):
    """Router + replica on their own event loop thread, so the tests can be plain functions."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    redis = EmbeddedRedis().start()

    async def start():
        replica = ReplicaServer(
            ReplicaConfig(str(qwen3_dir), "fuzz-0", redis.url, engine=EngineConfig(num_kv_blocks=256))
        )
        await replica.start()
        limits = RouterLimits(max_inflight=64, max_tokens=64)
        router = RouterServer(
            local_router_config(qwen3_dir, redis.url, limits=limits, max_message_bytes=1 << 20)
        )
        await router.start()
        while not router.registry.live():
            await router.registry.refresh()
            await asyncio.sleep(0.05)
        return router, replica

    router, replica = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    yield router
    asyncio.run_coroutine_threadsafe(router.stop(0.2), loop).result(60)
    asyncio.run_coroutine_threadsafe(replica.stop(0.2), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    redis.close()


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.just(math.nan),
    st.sampled_from([0.0, 1.0, -1.0]),
)
texts = st.one_of(
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=50),
    st.just("x" * 20_000),
    st.just(""),
)


@st.composite
def generate_requests(draw):
    """Mostly well-formed requests with one or two fields pushed somewhere odd: bugs hide
    behind otherwise valid input, not behind input the first check already refuses."""
    req = pb.GenerateRequest(request_id=draw(st.text(max_size=40)))
    kind = draw(st.sampled_from(["text", "ids", "chat"]))
    if kind == "text":
        req.text = draw(st.text(alphabet="abc xyz.", min_size=1, max_size=80))
    elif kind == "ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(3, 1000), min_size=1, max_size=120)))
    else:
        req.chat.messages.add(role="user", content=draw(st.text(max_size=60)))
    s = req.sampling
    s.max_tokens = draw(st.integers(1, 12))
    s.temperature = draw(st.sampled_from([0.0, 0.7, 1.0]))
    req.policy = draw(st.sampled_from(["", "prefix", "round_robin", "consistent_hash"]))
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        mutation = draw(st.sampled_from(MUTATIONS))
        mutation(req, draw)
    return req


def _text(req, draw):
    req.text = draw(texts)


def _ids(req, draw):
    req.token_ids.ids[:] = draw(st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 1100), max_size=300))


def _chat(req, draw):
    del req.chat.messages[:]
    for role, content in draw(st.lists(st.tuples(st.text(max_size=8), texts), max_size=4)):
        req.chat.messages.add(role=role, content=content)


MUTATIONS = [
    _text,
    _ids,
    _chat,
    lambda req, draw: setattr(req.sampling, "temperature", draw(floats)),
    lambda req, draw: setattr(req.sampling, "top_p", draw(floats)),
    lambda req, draw: setattr(req.sampling, "top_k", draw(st.integers(-(2**31), 2**31 - 1))),
    lambda req, draw: setattr(req.sampling, "max_tokens", draw(st.integers(0, 2**32 - 1))),
    lambda req, draw: setattr(req.sampling, "seed", draw(st.integers(0, 2**64 - 1))),
    lambda req, draw: setattr(req.sampling, "ignore_eos", draw(st.booleans())),
    lambda req, draw: req.sampling.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3))),
    lambda req, draw: req.sampling.stop_token_ids.extend(
        draw(st.lists(st.integers(0, 2**32 - 1), max_size=3))
    ),
    lambda req, draw: setattr(req, "policy", draw(st.text(max_size=10))),
    lambda req, draw: setattr(req, "affinity_key", draw(texts)),  # over its bound too
]


@FUZZ
@given(req=generate_requests())
def test_any_generate_request_gets_a_result_or_a_clean_error(servers, req):
    with grpc.insecure_channel(servers.address) as channel:
        try:
            responses = list(pb_grpc.RouterStub(channel).Generate(req, timeout=60))
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code, responses = exc.code(), []
            assert exc.details(), "an error without a message"
    assert code in CLEAN_GRPC, (code, req)
    if code == grpc.StatusCode.OK:
        assert responses and responses[-1].WhichOneof("kind") == "complete"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "n",
    "user",
    "policy",
    "ignore_eos",
]


@st.composite
def openai_bodies(draw):
    body = draw(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=8))
    if draw(st.booleans()):
        body["prompt"] = draw(texts | st.lists(st.integers(-5, 2000), max_size=50))
    if draw(st.booleans()):
        body["messages"] = [{"role": draw(st.text(max_size=6)), "content": draw(texts)}]
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 24:
        body["max_tokens"] = 24
    body.setdefault("max_tokens", 8)
    return body


@FUZZ
@given(body=openai_bodies(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_openai_body_gets_a_result_or_a_clean_error(servers, body, path):
    with httpx.Client(base_url=f"http://127.0.0.1:{servers.http_port}", timeout=60) as http:
        # json.dumps writes NaN/Infinity (not strict JSON): the server must cope with those too.
        response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code in CLEAN_HTTP, (response.status_code, response.text[:300], body)
    if response.status_code != 200 and "stream" not in str(body.get("stream")):
        assert response.json()["error"]["message"]


def test_malformed_http_bodies(servers):
    with httpx.Client(base_url=f"http://127.0.0.1:{servers.http_port}", timeout=30) as http:
        for raw in (b"", b"{", b"[1,2]", b"\xff\xfe", b'{"prompt": "x", "max_tokens": 1e999}'):
            r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.status_code, r.text)


def test_servers_are_healthy_after_fuzzing(servers):
    with grpc.insecure_channel(servers.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvmesh.v1.Router")
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        req = pb.GenerateRequest(
            text="still fine", sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
        responses = list(pb_grpc.RouterStub(channel).Generate(req, timeout=30))
    assert responses[-1].complete.usage.completion_tokens == 4
    assert servers.core.active == 0
