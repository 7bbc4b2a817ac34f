"""A Ray replica actor with a tiny model: gRPC streaming, the index it keeps, faults."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import eventually
from reference import hf_greedy, prompts_of_lengths

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache import block_hashes
from kvmesh.kvcache.index.redis import RedisPrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.actor import replica_actor_class
from kvmesh.replica.config import ReplicaConfig

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes

BLOCK = 16
ENGINE = EngineConfig(num_kv_blocks=256, block_size=BLOCK, max_num_seqs=8)


@pytest.fixture(scope="module")
def redis():
    """This module's own server: one test stops and restarts it."""
    server = EmbeddedRedis().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def replica(ray_cluster, qwen3_dir, redis):
    config = ReplicaConfig(str(qwen3_dir), "replica-a", redis.url, heartbeat_s=0.2, ttl_s=2.0, engine=ENGINE)
    actor = replica_actor_class(use_gpu=False).remote(config)
    address = ray_cluster.get(actor.start.remote(), timeout=120)
    yield actor, address
    ray_cluster.get(actor.stop.remote(grace=1.0), timeout=60)
    ray_cluster.kill(actor)


def index_for(redis, qwen3_dir) -> RedisPrefixIndex:
    from kvmesh.kvcache import namespace_seed

    return RedisPrefixIndex.from_url(redis.url, qwen3_dir.name, BLOCK, namespace_seed(qwen3_dir.name, BLOCK))


async def generate(address, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        return [r async for r in pb_grpc.ReplicaStub(channel).Generate(request, timeout=60)]


def greedy_request(ids, max_tokens=16, request_id="") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids), sampling=sampling)


async def stats(address) -> pb.ReplicaStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.ReplicaStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


async def test_a_continued_stream_streams_the_rest_and_counts_usage_once(replica):
    """A migrated stream as the router sends it: the prompt plus the tokens the client has,
    ``continued_tokens`` of them. The replica streams the uninterrupted run's remaining
    tokens, with the usage of the whole; one that had sent every token gets just its end."""
    _, address = replica
    prompt = prompts_of_lengths([40], salt=21)[0]
    whole = await generate(address, greedy_request(prompt, max_tokens=12))
    tokens = [t for r in whole if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids]
    for sent in (5, 12):
        request = greedy_request(prompt + tokens[:sent], max_tokens=12, request_id="moved")
        request.continued_tokens = sent
        rest = await generate(address, request)
        assert [t for r in rest if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids] == tokens[
            sent:
        ]
        complete = rest[-1].complete
        assert (complete.finish_reason, complete.usage.prompt_tokens, complete.usage.completion_tokens) == (
            "length",
            40,
            12,
        )
    request = greedy_request(prompt + tokens, max_tokens=12)
    request.continued_tokens = 13  # more than it may have sent
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(address, request)
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "continued_tokens" in refused.value.details()
    )


async def test_stream_returns_greedy_tokens_and_index_holds_the_prompt(replica, redis, qwen3_dir):
    _, address = replica
    prompt = prompts_of_lengths([70], salt=11)[0]
    responses = await generate(address, greedy_request(prompt, request_id="req-1"))
    chunks = [r.chunk for r in responses if r.WhichOneof("kind") == "chunk"]
    [complete] = [r.complete for r in responses if r.WhichOneof("kind") == "complete"]
    assert all(r.request_id == "req-1" for r in responses)
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(qwen3_dir, prompt, 16)
    assert complete.finish_reason == "length" and complete.replica_id == "replica-a"
    assert (complete.usage.prompt_tokens, complete.usage.completion_tokens) == (70, 16)

    index = index_for(redis, qwen3_dir)
    hashes = block_hashes(prompt, BLOCK, index.hash_seed)
    assert await eventually(lambda: _lookup_is(index, hashes, {"replica-a": 70 // BLOCK}))
    again = await generate(address, greedy_request(prompt))
    assert again[-1].complete.usage.cached_tokens == 64  # the replica's own prefix cache
    await index.close()


async def _lookup_is(index, hashes, expected):
    return await index.lookup(hashes) == expected


async def test_abort_and_client_cancellation_free_blocks(replica):
    _, address = replica
    total = (await stats(address)).num_blocks

    async def all_free():
        s = await stats(address)
        return s.num_free_blocks == total and s.num_running == 0

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ReplicaStub(channel)
        call = stub.Generate(greedy_request(prompts_of_lengths([40])[0], max_tokens=2000, request_id="long"))
        seen = [await call.read() for _ in range(3)]
        assert all(r.WhichOneof("kind") == "chunk" for r in seen)
        assert (await stub.Abort(pb.AbortRequest(request_id="long"))).found
        rest = []
        while (r := await call.read()) is not grpc.aio.EOF:
            rest.append(r)
        assert rest[-1].complete.finish_reason == "abort"
        assert not (await stub.Abort(pb.AbortRequest(request_id="long"))).found
        assert await eventually(all_free)

        call = stub.Generate(greedy_request(prompts_of_lengths([40])[0], max_tokens=2000))
        await call.read()
        call.cancel()  # the client goes away mid-stream
        assert await eventually(all_free)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "no input"),
        (pb.GenerateRequest(text=""), "prompt is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 10**6])), "outside the vocabulary"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("nan"))), "temperature"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=2)), "top_p"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=100_000)), "above the limit"),
    ],
    ids=["no-input", "empty", "vocab", "negative-temp", "nan-temp", "zero-max", "top-p", "too-long"],
)
async def test_bad_requests_are_invalid_argument(replica, request_, message):
    _, address = replica
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(address, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


async def test_text_and_chat_inputs(replica):
    _, address = replica
    sampling = pb.SamplingParams(temperature=0, max_tokens=4)
    text = await generate(address, pb.GenerateRequest(text="the cache block", sampling=sampling))
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="route this")])
    chatted = await generate(address, pb.GenerateRequest(chat=chat, sampling=sampling))
    assert text[-1].complete.usage.prompt_tokens > 0
    assert chatted[-1].complete.usage.prompt_tokens > text[-1].complete.usage.prompt_tokens


async def test_health_and_reflection(replica):
    _, address = replica
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.Replica"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name async for r in responses for s in r.list_services_response.service}
        assert {"kvmesh.v1.Replica", "grpc.health.v1.Health"} <= names


async def test_redis_outage_then_full_resync(replica, redis, qwen3_dir, ray_cluster):
    actor, address = replica
    redis.stop()
    try:
        for i in range(3):  # keeps serving while the index is away
            out = await generate(
                address, greedy_request(prompts_of_lengths([50], salt=100 + i)[0], max_tokens=8)
            )
            assert out[-1].complete.usage.completion_tokens == 8
        assert (await stats(address)).index_dirty
    finally:
        redis.start()  # same port, empty: everything the index had is gone
    index = index_for(redis, qwen3_dir)

    async def index_equals_cache():
        state = await asyncio.to_thread(ray_cluster.get, actor.index_state.remote())
        if state["dirty"]:
            return False
        cache = set(await asyncio.to_thread(ray_cluster.get, actor.cached_hashes.remote()))
        return (await index.snapshot()).get("replica-a") == cache and len(cache) > 0

    assert await eventually(index_equals_cache, timeout=20)
    await index.close()
