"""Nothing in the index can take the fleet down (issue 48): a real router and replica, in
process, beside bytes any router or replica user could write. Before, one malformed record
made every request a 500 and froze the router's view for good, and a settings change kept a
replica out of the index for good while its health said ok."""

import asyncio

import grpc
import httpx
import pytest
import pytest_asyncio
from helpers import eventually, live_replicas_are, local_router_config
from reference import prompts_of_lengths

from kvmesh.cli import status
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache.index.api import IndexSettingsError
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica import process as replica_process
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.process import RouterServer
from kvmesh.serving.metrics import read_samples

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(qwen3_dir):
    redis = EmbeddedRedis().start()
    replica = ReplicaServer(
        ReplicaConfig(
            str(qwen3_dir),
            "steady-0",
            redis.url,
            heartbeat_s=0.2,
            ttl_s=2.0,
            engine=EngineConfig(num_kv_blocks=256, block_size=16),
        )
    )
    await replica.start()
    replica.publisher.retry_s = 0.1
    router = RouterServer(local_router_config(qwen3_dir, redis.url))
    await router.start()
    await eventually(lambda: live_replicas_are(router, 1))
    yield router, replica, redis
    await router.stop(grace=0.5)
    await replica.stop(grace=0.5)
    redis.close()


def index_of(router: RouterServer):
    return router.registry.index


async def complete(router: RouterServer, salt: int) -> int:
    prompt = prompts_of_lengths([40], salt=salt)[0]
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(
            f"http://127.0.0.1:{router.http_port}/v1/completions",
            json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
        )
    return reply.status_code


async def generate(router: RouterServer, salt: int) -> str:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompts_of_lengths([40], salt=salt)[0]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(router.address) as channel:
        responses = [r async for r in pb_grpc.RouterStub(channel).Generate(request, timeout=30)]
    return responses[-1].complete.finish_reason


async def test_malformed_records_and_load_cost_only_themselves(stack):
    router = stack[0]
    index = index_of(router)
    ghost = await index.register("ghost", "127.0.0.1:9", ttl_s=60)
    assert ghost
    await index.client.hset(f"{index.ns}r:ghost", "slot", "x")  # int() failed every request
    await index.client.hset(f"{index.ns}load", mapping={"steady-0": "garbage", "ghost": b"\xff"})
    await router.registry.refresh()
    assert [e.record.replica_id for e in router.registry.live()] == ["steady-0"]
    assert await complete(router, 1) == 200
    assert await generate(router, 2) == "length"
    samples = read_samples(router.models.render_metrics().decode())
    assert samples[("kvmesh_router_index_skipped_entries_total", (("kind", "record"),))] >= 1
    await index.client.delete(f"{index.ns}r:ghost", f"{index.ns}load")
    await index.client.srem(f"{index.ns}replicas", "ghost")


async def test_a_registry_loop_that_fails_is_restarted_and_shown_in_health(stack, monkeypatch):
    router, _, _ = stack
    registry = router.registry
    real = registry.index.live_replicas
    calls = 0

    async def broken():
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError("a bug in reading the replicas")
        return await real()

    monkeypatch.setattr(registry.index, "live_replicas", broken)
    assert await eventually(lambda: _async(calls > 2), timeout=10)  # it failed twice and went on
    health = router.health()
    assert "kvmesh-registry" in health["failing_loops"]
    assert "a bug in reading the replicas" in health["failing_loops"]["kvmesh-registry"]
    assert health["status"] == "ok"
    models = await status.from_router(router.address, None)  # kvmesh status, through the router
    assert "a bug in reading the replicas" in models[0]["failing_loops"]["kvmesh-registry"]
    assert "router loop kvmesh-registry failing" in status.render(models)


async def test_settings_changed_under_a_replica_keep_it_out_until_restored_then_it_rejoins(
    stack, monkeypatch
):
    router, replica, _ = stack
    index = index_of(router)
    key = f"{index.ns}settings"
    stored = await index.client.hgetall(key)
    monkeypatch.setattr(replica_process, "OUT_OF_INDEX_S", 0.5)
    await index.client.hset(key, "block_size", "32")  # an admin's mistake, or a router before issue 48
    replica.publisher.sync_soon("test: sync now")  # the next sync meets the new settings
    assert await eventually(lambda: _async(replica.publisher.refused is not None), timeout=10)
    assert "block_size" in replica.publisher.refused
    assert await eventually(lambda: _async(replica.health()["status"] == "unhealthy"), timeout=10)
    assert "out of the index" in replica.health()["reason"]
    newcomer = RouterServer(local_router_config(replica.config.model_dir, index_url(stack)))
    try:
        with pytest.raises(IndexSettingsError, match="block_size"):  # a new router refuses, one line
            await newcomer.start()
    finally:
        await newcomer.stop(grace=0)
    await index.client.hset(key, mapping=stored)  # restored: the replica syncs and rejoins
    assert await eventually(lambda: _async(not replica.publisher.dirty), timeout=10)
    assert replica.health()["status"] == "ok"
    assert await eventually(lambda: live_replicas_are(router, 1), timeout=10)
    assert await complete(router, 3) == 200


def index_url(stack) -> str:
    return stack[2].url


async def _async(value: bool) -> bool:
    await asyncio.sleep(0)
    return value
