"""OpenTelemetry traces: a client's W3C traceparent (gRPC metadata or HTTP header) parents the
router's spans (tokenize, index lookup, decision, relay, first token), and the router's
relay span parents the replica's (request, queue, prefill), with the replica id and the
predicted and actual cached tokens as attributes. One router and one replica run in this
process over real gRPC and HTTP; spans go to the SDK's in-memory exporter."""

import asyncio

import grpc
import httpx
import pytest
import pytest_asyncio
from helpers import eventually, local_router_config
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.process import RouterServer
from kvmesh.serving import tracing

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
BS = 16


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traced(qwen3_dir):
    exporter = InMemorySpanExporter()
    tracing.configure("kvmesh-test", exporter=exporter)
    redis = EmbeddedRedis().start()
    engine = EngineConfig(num_kv_blocks=128, block_size=BS, max_model_len=512)
    replica = ReplicaServer(ReplicaConfig(str(qwen3_dir), "traced-0", redis.url, http_port=-1, engine=engine))
    await replica.start()
    router = RouterServer(local_router_config(qwen3_dir, redis.url))
    await router.start()
    assert await eventually(lambda: asyncio.sleep(0, result=bool(router.registry.live())))
    yield {"router": router, "exporter": exporter}
    await router.stop(grace=0.5)
    await replica.stop(grace=0.5)
    redis.close()
    tracing.disable()


def spans_of(exporter: InMemorySpanExporter) -> dict[str, object]:
    """Finished spans of the one trace, by name (the last of each name)."""
    return {s.name: s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == TRACE_ID}


def check_tree(spans: dict) -> None:
    root = spans["kvmesh.router.request"]
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN  # the client's span is the parent
    for child in (
        "kvmesh.router.tokenize",
        "kvmesh.router.index_lookup",
        "kvmesh.router.decision",
        "kvmesh.router.relay",
    ):
        assert spans[child].parent.span_id == root.context.span_id, child
    relay = spans["kvmesh.router.relay"]
    assert spans["kvmesh.router.first_token"].parent.span_id == relay.context.span_id
    replica = spans["kvmesh.replica.engine.request"]
    assert replica.parent.span_id == relay.context.span_id  # carried over gRPC metadata
    for phase in ("kvmesh.replica.queue", "kvmesh.replica.prefill"):
        assert spans[phase].parent.span_id == replica.context.span_id, phase
        assert spans[phase].start_time <= spans[phase].end_time
    assert relay.attributes["replica_id"] == replica.attributes["replica_id"] == "traced-0"
    assert spans["kvmesh.router.decision"].attributes["replica_id"] == "traced-0"
    assert relay.attributes["actual_cached_tokens"] == replica.attributes["cached_tokens"]
    assert "predicted_cached_tokens" in relay.attributes
    assert spans["kvmesh.replica.prefill"].end_time <= replica.end_time


async def test_a_grpc_request_is_one_trace_from_client_to_replica(traced):
    traced["exporter"].clear()
    ids = list(range(20, 20 + 3 * BS + 2))
    async with grpc.aio.insecure_channel(traced["router"].address) as channel:
        stub = pb_grpc.RouterStub(channel)
        for _ in range(2):  # the second reuses the first's blocks: predicted and actual both 3 blocks
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=2))
            async for _ in stub.Generate(req, metadata=(("traceparent", TRACEPARENT),), timeout=60):
                pass
    spans = spans_of(traced["exporter"])
    check_tree(spans)
    assert spans["kvmesh.router.relay"].attributes["actual_cached_tokens"] == 3 * BS
    assert spans["kvmesh.router.relay"].attributes["predicted_cached_tokens"] == 3 * BS


async def test_an_http_request_takes_its_traceparent_header(traced):
    traced["exporter"].clear()
    url = f"http://127.0.0.1:{traced['router'].http_port}/v1/completions"
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(
            url, json={"prompt": "hello there", "max_tokens": 2}, headers={"traceparent": TRACEPARENT}
        )
    assert reply.status_code == 200, reply.text
    check_tree(spans_of(traced["exporter"]))


async def test_without_a_traceparent_the_router_starts_the_trace(traced):
    traced["exporter"].clear()
    async with grpc.aio.insecure_channel(traced["router"].address) as channel:
        req = pb.GenerateRequest(text="no parent", sampling=pb.SamplingParams(max_tokens=1))
        async for _ in pb_grpc.RouterStub(channel).Generate(req, timeout=60):
            pass
    roots = [s for s in traced["exporter"].get_finished_spans() if s.name == "kvmesh.router.request"]
    assert len(roots) == 1 and roots[0].parent is None
