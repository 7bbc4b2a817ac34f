"""An engine=vllm replica is supervised over Ray like any replica: when its vLLM server dies
(an out-of-memory kill, say) the replica reports unhealthy, the supervisor retires it from
the index and starts a fresh actor, whose vLLM registers again and serves."""

import grpc
import pytest
import ray
from conftest import tiny_model_dir
from helpers import eventually, vllm_python

from kvmesh.cluster.supervisor import Supervisor
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache import namespace_seed
from kvmesh.kvcache.index.redis import RedisPrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.servers, pytest.mark.slow, pytest.mark.heavy]

BS = 32  # vLLM's CPU backend caches blocks in multiples of 32


async def generate(address: str, ids: list[int]) -> pb.Complete:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=2)
    )
    async with grpc.aio.insecure_channel(address) as channel:
        responses = [r async for r in pb_grpc.ReplicaStub(channel).Generate(request, timeout=120)]
    return responses[-1].complete


async def test_a_dead_vllm_is_replaced_by_the_supervisor(ray_cluster, valkey_server):
    model = tiny_model_dir("qwen3", hidden=128, heads=4)  # head size 32: vLLM's CPU floor
    engine = EngineConfig(block_size=BS, max_num_seqs=4, max_model_len=512, dtype="float32")
    template = ReplicaConfig(
        str(model),
        redis_url=valkey_server.url,
        model_id="supervised-vllm",
        engine=engine,
        engine_kind="vllm",
        vllm_python=vllm_python(),
        heartbeat_s=0.2,
        ttl_s=1.5,
    )
    index = RedisPrefixIndex.from_url(
        valkey_server.url, "supervised-vllm", BS, namespace_seed("supervised-vllm", BS)
    )
    sup = Supervisor(template, 1, False, index, check_s=0.5, start_timeout_s=240)
    try:
        await index.load_functions()  # the deployment's admin does, as `kvmesh up` does
        await sup.start()
        actor = sup.actors["replica-0"]
        old_pid = await actor.pid.remote()
        prompt = list(range(10, 10 + 2 * BS + 3))
        assert (await generate(sup.addresses["replica-0"], prompt)).usage.completion_tokens == 2
        assert await eventually(index.live_replicas, timeout=10)
        before = {r.replica_id: r.incarnation for r in await index.live_replicas()}
        assert list(before) == ["replica-0"]

        await actor.kill_engine.remote()  # vLLM's server process dies; the actor lives on

        async def replaced() -> bool:
            slot = sup.slots["replica-0"]
            return sup.restarts == 1 and slot.state == "ready"

        assert await eventually(replaced, timeout=240)  # a fresh actor starts a fresh vLLM
        with pytest.raises(ray.exceptions.RayActorError):
            await actor.pid.remote()  # the old actor was killed, not reused
        assert await sup.actors["replica-0"].pid.remote() != old_pid

        async def registered_anew() -> bool:
            after = {r.replica_id: r.incarnation for r in await index.live_replicas()}
            return list(after) == ["replica-0"] and after["replica-0"] != before["replica-0"]

        assert await eventually(registered_anew, timeout=10)
        done = await generate(sup.addresses["replica-0"], prompt)
        assert done.usage.completion_tokens == 2 and done.usage.cached_tokens == 0  # a cold cache
        fresh = sup.actors["replica-0"]
        assert (await fresh.health.remote())["status"] == "ok"

        async def indexed_exactly() -> bool:  # what vLLM's events said, re-hashed, and no more
            held = set(await fresh.cached_hashes.remote())
            return bool(held) and (await index.snapshot()).get("replica-0", set()) == held

        assert await eventually(indexed_exactly, timeout=10)
    finally:
        await sup.stop(grace=1)
        await index.close()
