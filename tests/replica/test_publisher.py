"""The index publisher in-process (no Ray): cache resets and buffer overflow force a resync."""

import asyncio
import contextlib
import time

import pytest
from helpers import eventually
from reference import prompts_of_lengths

from kvmesh.cli import status
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine import SamplingParams
from kvmesh.engine.config import EngineConfig, GiB
from kvmesh.kvcache import block_hashes
from kvmesh.kvcache.events import HOST
from kvmesh.protos import pb
from kvmesh.replica.backend import usage
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.decision import Decision
from kvmesh.serving.metrics import read_samples

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes


@contextlib.asynccontextmanager
async def replica(qwen3_dir, **engine):
    redis = EmbeddedRedis().start()
    config = ReplicaConfig(
        str(qwen3_dir),
        "pub-test",
        redis.url,
        heartbeat_s=0.1,
        ttl_s=2.0,
        engine=EngineConfig(block_size=16, **engine),
    )
    server = ReplicaServer(config)
    await server.start()
    server.publisher.retry_s = 0.1
    try:
        yield server, redis
    finally:
        await server.stop(grace=0.5)
        redis.close()


@pytest.fixture
async def served(qwen3_dir):
    async with replica(qwen3_dir, num_kv_blocks=128) as served:
        yield served


async def run_request(server, salt: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    async for _ in server.engine.generate(prompts_of_lengths([48], salt=salt)[0], params):
        pass


async def index_matches_cache(server) -> bool:
    if server.publisher.dirty:
        return False
    cache = await server.engine.call(lambda e: e.block_manager.cached_hashes())
    return (await server.publisher.index.snapshot()).get("pub-test", set()) == cache


async def test_events_reach_the_index(served):
    server, _ = served
    await run_request(server, 1)
    assert await eventually(lambda: index_matches_cache(server))
    assert len(await server.engine.call(lambda e: e.block_manager.cached_hashes())) == 3


async def test_an_idle_publisher_sleeps_and_a_step_wakes_it(served):
    """Idle and in sync, the events loop waits on the engine, not on a short timer (it used to
    wake every 5 ms); a step's events reach the index at once, not at the timeout."""
    server, _ = served
    await run_request(server, 3)
    assert await eventually(lambda: index_matches_cache(server))
    server.publisher.retry_s = 2.0
    engine, waits = server.engine, []
    wait = engine.wait_kv_events

    async def counted(timeout: float) -> None:
        waits.append(timeout)
        await wait(timeout)

    engine.wait_kv_events = counted
    await asyncio.sleep(1.0)
    assert len(waits) <= 2, waits  # 200 at the old 5 ms
    await run_request(server, 4)
    done = time.monotonic()
    assert await eventually(lambda: index_matches_cache(server), timeout=5)
    assert time.monotonic() - done < 0.5  # woken by the step's events, not the 2 s timeout


async def test_cache_reset_resyncs_to_empty(served):
    server, _ = served
    await run_request(server, 2)
    assert await eventually(lambda: index_matches_cache(server))
    before = server.publisher.incarnation
    await server.engine.call(lambda e: e.reset_prefix_cache())
    assert await eventually(lambda: index_matches_cache(server))
    assert server.publisher.incarnation > before
    assert (await server.publisher.index.snapshot())["pub-test"] == set()


async def test_buffer_overflow_while_redis_is_down_then_resync(served):
    server, redis = served
    server.publisher.max_buffered_events = 1
    redis.stop()
    await run_request(server, 3)
    await run_request(server, 4)
    assert await eventually(lambda: asyncio.sleep(0, result=server.publisher.dirty))
    await asyncio.sleep(0.3)  # several flush rounds while Redis is away
    assert len(server.publisher._buffer) <= server.publisher.max_buffered_events  # dropped, not grown
    redis.start()
    assert await eventually(lambda: index_matches_cache(server))
    assert len(await server.engine.call(lambda e: e.block_manager.cached_hashes())) == 6


async def index_matches_tiers(server) -> bool:
    """The index holds exactly the replica's device and host tiers (a host tier in use)."""
    device, host = await server.engine.call(
        lambda e: (e.block_manager.cached_hashes(), e.block_manager.host.cached_hashes())
    )
    index = server.publisher.index
    return (
        not server.publisher.dirty
        and (await index.snapshot())["pub-test"] == device
        and (await index.snapshot(HOST))["pub-test"] == host
        and bool(host)
    )


async def test_a_block_that_leaves_both_tiers_leaves_the_index(qwen3_dir):
    block_bytes = 8192  # the tiny model's (checked below): a host tier of 6 blocks
    async with replica(qwen3_dir, num_kv_blocks=8, host_kv_gib=6 * block_bytes / GiB) as (server, _):
        assert await server.engine.call(
            lambda e: (e.runner.block_bytes, e.block_manager.host.num_blocks)
        ) == (
            block_bytes,
            6,
        )
        prompts = prompts_of_lengths([80, 96, 96, 96, 96], salt=31)
        for prompt in prompts:
            await run_prompt(server, prompt)
        assert await eventually(lambda: index_matches_tiers(server))
        first = set(block_hashes(prompts[0], 16, server.publisher.index.hash_seed))
        held = await server.engine.call(
            lambda e: e.block_manager.cached_hashes() | e.block_manager.host.cached_hashes()
        )
        assert not first & held  # pushed out of the device, then out of the host
        index = server.publisher.index
        assert not first & ((await index.snapshot())["pub-test"] | (await index.snapshot(HOST))["pub-test"])


async def run_prompt(server, prompt: list[int]) -> None:
    async for _ in server.engine.generate(
        prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ):
        pass


async def test_a_host_tier_is_published_and_resynced_with_the_device_tier(qwen3_dir):
    """Blocks pushed out of a small device pool land in the host tier and in the index's host
    bitmaps; a router's view counts them after the device's; a resync publishes both tiers."""
    async with replica(qwen3_dir, num_kv_blocks=8, host_kv_gib=0.002) as (server, redis):
        prompts = prompts_of_lengths([80, 96, 96], salt=21)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for prompt in prompts:
            await run_prompt(server, prompt)

        assert await eventually(lambda: index_matches_tiers(server))
        first = block_hashes(prompts[0], 16, server.publisher.index.hash_seed)
        view = await server.publisher.index.routing_view(first)
        assert view.tiered["pub-test"] == len(first) > view.matched.get("pub-test", 0)
        # what the router predicts from that view, by tier, is what the replica reports reusing
        decision = Decision(
            "q", prompts[0], first, pb.SamplingParams(), [], {}, "prefix", 0.0, view.matched, {}, view.tiered
        )
        predicted = decision.prediction("pub-test", server.publisher.incarnation, 16)
        outputs = [out async for out in server.engine.generate(prompts[0], params)]
        served = usage(outputs[-1])
        assert served.host_cached_tokens > 0
        assert (served.cached_tokens, served.host_cached_tokens) == (
            predicted.predicted * 16,
            predicted.host * 16,
        )

        async def restores_priced(server=server) -> bool:  # its heartbeat says what a restore cost
            [record] = await server.publisher.index.live_replicas()
            measured = record.load("cost_restore_blocks") >= served.host_cached_tokens // 16
            return measured and record.load("cost_restore_block_s") > 0

        assert await eventually(restores_priced)
        stats = server.engine.stats().host
        samples = read_samples(server.backend.render_metrics().decode())
        assert samples[("kvmesh_replica_host_kv_blocks", ())] == stats.num_blocks > 0
        assert samples[("kvmesh_replica_host_kv_used_blocks", ())] == stats.num_used_blocks > 0
        assert samples[("kvmesh_replica_host_restored_blocks_total", ())] == stats.restored_blocks > 0
        assert samples[("kvmesh_replica_host_cached_prompt_tokens_total", ())] == stats.hit_tokens > 0
        assert samples[("kvmesh_replica_host_restore_block_seconds", ())] > 0
        (model,) = await status.from_index(redis.url)  # kvmesh status, read from the index
        (row,) = model["replicas"]
        assert (row["num_host_blocks"], row["num_host_used_blocks"]) == (
            stats.num_blocks,
            stats.num_used_blocks,
        )
        assert f"{stats.num_used_blocks}/{stats.num_blocks}" in status.render([model]).split("host")[-1]
        incarnation = server.publisher.incarnation
        await server.publisher.resync("a test asks")
        assert server.publisher.incarnation > incarnation
        assert await eventually(lambda: index_matches_tiers(server))
