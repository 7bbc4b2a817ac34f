"""The prefix index on a real Valkey Cluster on loopback (3 primaries, a replica each):
``redis+cluster://`` URLs, one model's chains spread over every shard, a decision still one
call to one shard, sweeps on every primary, and an exact index after a primary fails over."""

import itertools
import random

import pytest
import redis

from kvmesh.cluster.embedded_cluster import EmbeddedRedisCluster
from kvmesh.kvcache import BlockStored
from kvmesh.kvcache.index.redis import RedisPrefixIndex

pytestmark = pytest.mark.servers

_models = itertools.count()


def cluster_url(cluster) -> str:
    return cluster.url.replace("redis://", "redis+cluster://")


def chains(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.getrandbits(64) for _ in range(length)] for _ in range(n)]


async def publish(index: RedisPrefixIndex, rid: str, inc: int, held: list[list[int]]) -> None:
    assert await index.publish(rid, inc, [BlockStored(tuple(c), None, 16, c[0]) for c in held])


async def test_publish_lookup_decide_and_sweep_across_shards(valkey_cluster):
    index = RedisPrefixIndex.from_url(cluster_url(valkey_cluster), f"cluster-{next(_models)}", 16, 1)
    await index.ensure_settings()
    some = chains(300, 8, seed=1)
    a = await index.register("r0", "a:1", ttl_s=30)
    b = await index.register("r1", "b:1", ttl_s=30)
    await publish(index, "r0", a, some)
    await publish(index, "r1", b, [c[:3] for c in some[:100]])
    router = await index.register_router(ttl_s=30)
    assert await index.share(router, {"r0|n": 1.0}, [("r1", some[5][0], some[5])], ttl_s=30)
    for i in (0, 5, 150, 299):
        view = await index.routing_view(some[i])
        assert view.matched == ({"r0": 8, "r1": 3} if i < 100 else {"r0": 8})
        assert view.speculative == ({"r1": 8} if i == 5 else {}) and view.fleet["r0"].requests == 1.0

    # one model's keys spread over every shard (>= 100 prefixes: within +-20% of the mean)
    per_shard = []
    for host, port in valkey_cluster.primaries():
        node = redis.Redis(host=host, port=port)
        keys = node.scan_iter(match=index.block_pattern, count=1000)
        per_shard.append(sum(1 for key in keys if len(key) == index.block_key_length))  # not speculation
        node.close()
    mean = sum(per_shard) / len(per_shard)
    assert sum(per_shard) == 300 * 8 and all(abs(n - mean) <= 0.2 * mean for n in per_shard), per_shard

    await index.register("r0", "a:1", ttl_s=30)  # r0 restarted: its 2400 entries are stale
    passes, control = [], index._control

    async def spy(name, *args, **kwargs):
        passes.append(name)
        return await control(name, *args, **kwargs)

    index._control = spy
    gone = 0
    for _ in range(3):  # ~500 keys a step on each primary (~800 each)
        gone += await index.sweep()
    assert gone == 2400
    assert "swept" in passes  # every primary's keys were visited: a pass ended
    index._control = control
    assert await index.lookup(some[0]) == {"r1": 3}
    await index.close()


async def test_the_index_is_exact_again_after_a_primary_fails_over():
    """A primary dies (what it had not replicated yet is lost); the replica publishers
    notice nothing until they resync, and after a resync every lookup is exact again."""
    with EmbeddedRedisCluster() as cluster:
        index = RedisPrefixIndex.from_url(cluster_url(cluster), "failover-model", 16, 1)
        await index.ensure_settings()
        held = chains(60, 6, seed=2)
        inc = await index.register("r0", "a:1", ttl_s=60)
        await publish(index, "r0", inc, held)
        victim = cluster.primary_for_key(index.tag(held[0][0]))
        on_victim = [c for c in held if cluster.primary_for_key(index.tag(c[0])) == victim]
        assert on_victim and len(on_victim) < len(held)
        cluster.kill_primary(victim)

        inc = await index.register("r0", "a:1", ttl_s=60)  # the replica resyncs
        assert await index.publish_all("r0", inc, {h: c[0] for c in held for h in c})
        for c in held:
            assert await index.lookup(c) == {"r0": 6}
        assert await index.snapshot() == {"r0": {h for c in held for h in c}}
        await index.close()


async def test_a_shard_that_lost_the_library_gets_its_calls_again_and_no_one_else_twice(valkey_cluster):
    """A decision's and a router's pipelines span shards: when one shard lost the functions
    (restarted, new), only its calls are sent again: a reservation on another is applied once."""
    index = RedisPrefixIndex.from_url(cluster_url(valkey_cluster), f"cluster-{next(_models)}", 16, 1)
    inc = await index.register("r0", "a:1", ttl_s=30)
    router = await index.register_router(ttl_s=30)
    chain = next(
        c
        for c in chains(50, 4, seed=3)
        if valkey_cluster.primary_for_key(index.tag(c[0]))
        != valkey_cluster.primary_for_key(index.ns.encode())
    )
    await publish(index, "r0", inc, [chain])
    node = redis.Redis(port=valkey_cluster.primary_for_key(index.tag(chain[0])))
    node.function_flush()
    assert await index.share(router, {"r0|n": 1.0}, [("r0", chain[0], chain)], ttl_s=30)
    assert (await index.routing_view(chain)).fleet["r0"].requests == 1.0
    node.close()
    await index.close()
