"""The shared prefix index against a real server (valkey-server, and redis-server where installed)."""

import asyncio
import itertools
import random

import pytest
import redis.asyncio as aioredis

from kvmesh.kvcache import BlockRemoved, BlockStored
from kvmesh.kvcache.index import IndexSettingsError, PrefixIndex

pytestmark = pytest.mark.servers  # starts Redis, Ray, servers or kvmesh processes

_models = itertools.count()


@pytest.fixture
async def index(redis_server):
    """A fresh namespace per test (a new model id), on the session's server."""
    idx = PrefixIndex.from_url(redis_server.url, f"test-model-{next(_models)}", 16, 1234)
    await idx.ensure_settings()
    yield idx
    await idx.close()


def expected_depths(query: list[int], holdings: dict[str, set[int]]) -> dict[str, int]:
    """The reference: leading blocks of ``query`` each live replica holds consecutively."""
    out = {}
    for rid, held in holdings.items():
        depth = 0
        while depth < len(query) and query[depth] in held:
            depth += 1
        if depth:
            out[rid] = depth
    return out


async def test_lookup_matches_reference_on_random_chains(index):
    rng = random.Random(7)
    chains = [[rng.getrandbits(64) for _ in range(40)] for _ in range(6)]
    holdings: dict[str, set[int]] = {}
    for r in range(8):
        rid = f"replica-{r}"
        inc = await index.register(rid, f"127.0.0.1:{9000 + r}", ttl_s=30)
        held: set[int] = set()
        events = []
        for chain in rng.sample(chains, 3):  # each replica caches a prefix of 3 chains...
            stored = chain[: rng.randint(1, 40)]
            held.update(stored)
            events.append(BlockStored(tuple(stored), None, 16))
            gone = rng.sample(stored, k=min(len(stored), rng.randint(0, 3)))  # ...with a few evictions
            held.difference_update(gone)
            events.append(BlockRemoved(tuple(gone)))
        assert await index.publish(rid, inc, events)
        holdings[rid] = held
    queries = [c[:n] for c in chains for n in (1, 5, 40)]
    queries += [c[:10] + [rng.getrandbits(64)] + c[11:] for c in chains]  # diverges at block 10
    queries += [[rng.getrandbits(64)] + c[1:] for c in chains]  # unknown first block
    for q in queries:
        assert await index.lookup(q) == expected_depths(q, holdings)
    assert await index.snapshot() == holdings


async def test_stale_incarnation_is_ignored_and_cannot_publish(index):
    chain = list(range(1, 11))
    old = await index.register("r0", "a:1", ttl_s=30)
    assert await index.publish("r0", old, [BlockStored(tuple(chain), None, 16)])
    assert await index.lookup(chain) == {"r0": 10}
    new = await index.register("r0", "a:1", ttl_s=30)  # restarted: the old entries retire at once
    assert new > old
    assert await index.lookup(chain) == {}
    assert not await index.publish("r0", old, [BlockStored((99,), None, 16)])  # told to resync
    assert not await index.heartbeat("r0", old, ttl_s=30)
    assert await index.publish("r0", new, [BlockStored(tuple(chain[:3]), None, 16)])
    assert await index.lookup(chain) == {"r0": 3}


async def test_heartbeat_ttl_expiry_removes_a_replica(index):
    inc = await index.register("r0", "a:1", ttl_s=0.4)
    await index.publish("r0", inc, [BlockStored((1, 2, 3), None, 16)])
    await asyncio.sleep(0.25)
    assert await index.heartbeat("r0", inc, ttl_s=0.4, load={"num_running": 3})
    await asyncio.sleep(0.25)  # alive thanks to the heartbeat
    assert await index.lookup([1, 2, 3]) == {"r0": 3}
    [record] = await index.live_replicas()
    assert (
        record.replica_id == "r0" and record.load("num_running") == 3 and 0 < record.heartbeat_ttl_ms <= 400
    )
    await asyncio.sleep(0.6)  # no heartbeat: expired
    assert await index.lookup([1, 2, 3]) == {}
    assert await index.live_replicas() == []
    assert not await index.heartbeat("r0", inc, ttl_s=0.4)


async def test_deregister_is_immediate(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", inc, [BlockStored((5, 6), None, 16)])
    assert await index.deregister("r0", inc)
    assert await index.lookup([5, 6]) == {}
    assert await index.live_replicas() == []


async def test_resync_after_a_lost_batch(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    truth = set(range(100, 200))
    await index.publish("r0", inc, [BlockStored(tuple(range(100, 150)), None, 16)])
    # The batch storing 150..199 and removing 100..109 is lost (connection dropped).
    truth -= set(range(100, 110))
    assert (await index.snapshot())["r0"] != truth
    inc2 = await index.register("r0", "a:1", ttl_s=30)
    assert await index.publish_all("r0", inc2, truth)
    assert (await index.snapshot())["r0"] == truth


async def test_lookup_is_one_round_trip(index, redis_server):
    inc = await index.register("r0", "a:1", ttl_s=30)
    chain = list(range(1000, 1128))
    await index.publish("r0", inc, [BlockStored(tuple(chain), None, 16)])
    await index.lookup(chain)  # warm: the library is loaded
    observer = aioredis.Redis.from_url(redis_server.url)
    before = await observer.info("commandstats")
    sent = []
    original = index.client.execute_command

    async def spy(*args, **kwargs):
        sent.append(args[0])
        return await original(*args, **kwargs)

    index.client.execute_command = spy
    assert await index.lookup(chain) == {"r0": 128}
    after = await observer.info("commandstats")
    await observer.aclose()
    assert len(sent) == 1 and sent[0].upper().startswith("FCALL")
    fcalls = {
        k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"]
        for k in after
        if k.startswith("cmdstat_fcall")
    }
    assert sum(fcalls.values()) == 1


async def test_concurrent_publishers_and_lookups(index):
    rng = random.Random(3)
    chain = [rng.getrandbits(64) for _ in range(64)]
    holdings: dict[str, set[int]] = {}

    async def publisher(r: int):
        rid = f"r{r}"
        inc = await index.register(rid, f"h:{r}", ttl_s=30)
        held: set[int] = set()
        local = random.Random(r)
        for _ in range(50):
            n = local.randint(1, 64)
            if local.random() < 0.7:
                ev = BlockStored(tuple(chain[:n]), None, 16)
                held.update(chain[:n])
            else:
                ev = BlockRemoved(tuple(chain[n - 1 :]))
                held.difference_update(chain[n - 1 :])
            assert await index.publish(rid, inc, [ev])
            await asyncio.sleep(0)
        holdings[rid] = held

    async def reader():
        for _ in range(100):
            found = await index.lookup(chain)
            assert set(found) <= {f"r{r}" for r in range(8)} and all(1 <= d <= 64 for d in found.values())
            await asyncio.sleep(0)

    await asyncio.gather(*(publisher(r) for r in range(8)), *(reader() for _ in range(4)))
    assert await index.lookup(chain) == expected_depths(chain, holdings)


async def test_sweep_removes_entries_of_dead_incarnations(index):
    old = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", old, [BlockStored(tuple(range(1, 301)), None, 16)])
    other = await index.register("r1", "b:1", ttl_s=30)
    await index.publish("r1", other, [BlockStored(tuple(range(1, 11)), None, 16)])
    await index.register("r0", "a:1", ttl_s=30)  # r0 restarted: 300 stale entries
    removed, cursor = 0, 0
    while True:
        cursor, n = await index.sweep(cursor, count=50)
        removed += n
        if cursor == 0:
            break
    assert removed == 300
    assert await index.lookup(list(range(1, 11))) == {"r1": 10}
    keys = [k async for k in index.client.scan_iter(match=f"{index.ns}b*".encode())]
    assert len(keys) == 10  # emptied sets are deleted


async def test_cluster_settings_are_stored_once_and_enforced(redis_server):
    a = PrefixIndex.from_url(redis_server.url, "settings-model", 16, 42)
    await a.ensure_settings()
    await a.ensure_settings()  # same settings: fine
    for wrong in (
        PrefixIndex.from_url(redis_server.url, "settings-model", 32, 42),
        PrefixIndex.from_url(redis_server.url, "settings-model", 16, 43),
    ):
        with pytest.raises(IndexSettingsError, match="cluster has"):
            await wrong.ensure_settings()
        await wrong.close()
    await a.close()


async def test_library_reloads_after_server_lost_it(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.client.function_flush()  # what a restarted server without persistence looks like
    assert await index.publish("r0", inc, [BlockStored((1,), None, 16)])
    assert await index.lookup([1]) == {"r0": 1}


async def test_hashes_use_the_full_64_bits(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    chain = [2**64 - 1, 0, 2**63]
    await index.publish("r0", inc, [BlockStored(tuple(chain), None, 16)])
    assert await index.lookup(chain) == {"r0": 3}
    assert (await index.snapshot())["r0"] == set(chain)


async def test_lookup_bisection_with_every_replica_at_a_different_depth(index):
    rng = random.Random(11)
    chain = [rng.getrandbits(64) for _ in range(128)]
    holdings = {}
    for r in range(40):
        rid = f"r{r}"
        inc = await index.register(rid, "h:1", ttl_s=30)
        held = set(chain[: rng.randint(1, 128)])
        held -= set(rng.sample(sorted(held), k=min(len(held), rng.randint(0, 2))))  # holes
        await index.publish(rid, inc, [BlockStored(tuple(held), None, 16)])
        holdings[rid] = held
    for n in (1, 2, 3, 17, 64, 127, 128):
        assert await index.lookup(chain[:n]) == expected_depths(chain[:n], holdings)


async def test_retire_ends_the_current_incarnation(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", inc, [BlockStored((7, 8), None, 16)])
    assert await index.retire("r0")
    assert await index.lookup([7, 8]) == {} and await index.live_replicas() == []
    assert not await index.heartbeat("r0", inc, ttl_s=30)
    assert not await index.retire("nobody")
