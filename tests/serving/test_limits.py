"""Overload and limits: bounded queues answer RESOURCE_EXHAUSTED at once, oversized or
over-long work is refused, deadlines are honoured and free their blocks, drains finish
what they accepted."""

import asyncio
import time

import grpc
import httpx
import pytest
import pytest_asyncio
from helpers import eventually, live_replicas_are, local_router_config
from reference import prompts_of_lengths

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.config import RouterLimits
from kvmesh.router.process import RouterServer

module_loop = pytest.mark.asyncio(loop_scope="module")
pytestmark = [module_loop, pytest.mark.servers]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(qwen3_dir):
    redis = EmbeddedRedis().start()
    replicas = []
    for i in range(2):
        engine = EngineConfig(num_kv_blocks=128, max_num_seqs=2, max_queued_requests=2)
        r = ReplicaServer(
            ReplicaConfig(str(qwen3_dir), f"lim-{i}", redis.url, heartbeat_s=0.2, engine=engine)
        )
        await r.start()
        replicas.append(r)
    limits = RouterLimits(max_inflight=6, max_prompt_tokens=500, max_tokens=300)
    router = RouterServer(
        local_router_config(qwen3_dir, redis.url, limits=limits, max_message_bytes=64 << 10)
    )
    await router.start()
    await eventually(lambda: live_replicas_are(router, 2))
    yield router, replicas, redis
    await router.stop(grace=0.5)
    for r in replicas:
        await r.stop(grace=0.5)
    redis.close()


def request(max_tokens=8, salt=0, n=30, **kw) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompts_of_lengths([n], salt=salt)[0]), sampling=sampling, **kw
    )


async def run(address, req, timeout=60):
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        return [r async for r in pb_grpc.RouterStub(channel).Generate(req, timeout=timeout)]


async def outcome(address, req, timeout=60) -> str:
    try:
        await run(address, req, timeout)
        return "ok"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


async def test_replica_queue_limit_refuses_at_once(stack):
    _, replicas, _ = stack
    address = replicas[0].address
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True)
    )

    async def direct():
        async with grpc.aio.insecure_channel(address) as channel:
            start = time.monotonic()
            try:
                [r async for r in pb_grpc.ReplicaStub(channel).Generate(req, timeout=120)]
                return "ok", time.monotonic() - start
            except grpc.aio.AioRpcError as exc:
                return exc.code().name, time.monotonic() - start

    results = await asyncio.gather(*(direct() for _ in range(8)))  # 2 run, 2 wait, the rest are refused
    refused = [t for code, t in results if code == "RESOURCE_EXHAUSTED"]
    assert len(refused) >= 3 and all(code in ("ok", "RESOURCE_EXHAUSTED") for code, _ in results)
    assert max(refused) < 2.0  # at once, not after waiting


async def test_router_inflight_limit_is_429_and_resource_exhausted(stack):
    router, _, _ = stack
    results = await asyncio.gather(
        *(outcome(router.address, request(max_tokens=200, salt=i)) for i in range(12))
    )
    assert results.count("RESOURCE_EXHAUSTED") >= 4 and set(results) <= {"ok", "RESOURCE_EXHAUSTED"}
    assert results.count("ok") >= 2

    async def http_burst():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60) as http:
            body = {"prompt": list(range(3, 40)), "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))

    codes = [r.status_code for r in await http_burst()]
    assert 429 in codes and set(codes) <= {200, 429}


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request(n=600), "limit is 500"),
        (request(max_tokens=301), "max_tokens 301 is above the limit 300"),
    ],
    ids=["prompt-too-long", "max-tokens-ceiling"],
)
async def test_limits_on_prompt_and_max_tokens(stack, req, message):
    router, _, _ = stack
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run(router.address, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


async def test_oversized_messages_are_refused(stack):
    router, _, _ = stack
    huge = pb.GenerateRequest(text="x " * 100_000)  # ~200 KB > the 64 KiB limit
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run(router.address, huge)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as http:
        r = await http.post("/v1/completions", json={"prompt": "x " * 100_000})
        assert r.status_code == 413


async def test_deadlines_are_honoured_and_free_the_blocks(stack):
    router, replicas, _ = stack
    started = time.monotonic()
    code = await outcome(router.address, request(max_tokens=300, salt=7), timeout=0.15)
    assert code == "DEADLINE_EXCEEDED" and time.monotonic() - started < 3

    async def idle():
        return all(r.engine.stats().kv.num_used_blocks == 0 and not r.engine.num_streams() for r in replicas)

    assert await eventually(idle)


async def test_router_drain_finishes_inflight_and_refuses_new_work(stack, qwen3_dir):
    _, _, redis = stack
    second = RouterServer(local_router_config(qwen3_dir, redis.url, http_port=-1))
    await second.start()
    await eventually(lambda: live_replicas_are(second, 2))
    inflight = asyncio.create_task(run(second.address, request(max_tokens=60, salt=11)))
    await eventually(lambda: asyncio.sleep(0, result=second.core.active == 1))
    stopping = asyncio.create_task(second.stop(grace=30))
    await eventually(lambda: asyncio.sleep(0, result=second.core.draining))
    assert await outcome(second.address, request(salt=12)) == "UNAVAILABLE"  # refused while draining
    responses = await inflight  # but the accepted one finishes
    assert responses[-1].complete.usage.completion_tokens == 60
    await stopping


async def test_replica_drain_leaves_the_index_first(stack, qwen3_dir):
    router, _, redis = stack
    extra = ReplicaServer(
        ReplicaConfig(
            str(qwen3_dir), "lim-extra", redis.url, heartbeat_s=0.2, engine=EngineConfig(num_kv_blocks=64)
        )
    )
    await extra.start()
    await eventually(lambda: live_replicas_are(router, 3))
    async with grpc.aio.insecure_channel(extra.address) as channel:
        call = pb_grpc.ReplicaStub(channel).Generate(request(max_tokens=40, salt=13))
        await call.read()
        stopping = asyncio.create_task(extra.stop(grace=30))
        assert await eventually(
            lambda: live_replicas_are(router, 2), timeout=5
        )  # gone from the index at once
        rest = []
        while (r := await call.read()) is not grpc.aio.EOF:
            rest.append(r)
        assert rest[-1].complete.usage.completion_tokens == 40  # yet its stream finished
    await stopping
