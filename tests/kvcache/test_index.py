"""The shared prefix index's contract, on both implementations: a real server (valkey-server,
and redis-server where installed) and the in-memory one the simulator uses. Tests that look at
Redis itself (round trips, keys, the library) take ``redis_index`` (both in tests/conftest.py)."""

import asyncio
import random

import pytest
import redis
import redis.asyncio as aioredis
from index_cases import expected_depths, removed, stored

from kvmesh.kvcache.index.api import IndexSettingsError
from kvmesh.kvcache.index.memory import MemoryPrefixIndex
from kvmesh.kvcache.index.redis import VERSION, RedisPrefixIndex

pytestmark = pytest.mark.servers  # the Redis half starts a server


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
            n = rng.randint(1, 40)
            events.append(stored(chain, n))
            kept = n - rng.randint(0, 3)  # ...with a few blocks evicted from the tail
            events.append(removed(chain[:n], max(kept, 0)))
            held.update(chain[: max(kept, 0)])
        assert await index.publish(rid, inc, events)
        holdings[rid] = held
    queries = [c[:n] for c in chains for n in (1, 5, 40)]
    queries += [c[:10] + [rng.getrandbits(64) for _ in range(30)] for c in chains]  # diverges at block 10
    queries += [[rng.getrandbits(64)] + c[1:] for c in chains]  # unknown first block
    for q in queries:
        assert await index.lookup(q) == expected_depths(q, holdings)
    assert await index.snapshot() == holdings


async def test_stale_incarnation_is_ignored_and_cannot_publish(index):
    chain = list(range(1, 11))
    old = await index.register("r0", "a:1", ttl_s=30)
    assert await index.publish("r0", old, [stored(chain, 10)])
    assert await index.lookup(chain) == {"r0": 10}
    new = await index.register("r0", "a:1", ttl_s=30)  # restarted: the old entries retire at once
    assert new > old
    assert await index.lookup(chain) == {}
    assert not await index.publish("r0", old, [stored([99], 1)])  # told to resync
    assert not await index.heartbeat("r0", old, ttl_s=30)
    assert await index.publish("r0", new, [stored(chain, 3)])
    assert await index.lookup(chain) == {"r0": 3}


async def test_heartbeat_ttl_expiry_removes_a_replica(index):
    inc = await index.register("r0", "a:1", ttl_s=0.4)
    await index.publish("r0", inc, [stored([1, 2, 3], 3)])
    await asyncio.sleep(0.25)
    assert await index.heartbeat("r0", inc, ttl_s=0.4, load={"num_running": 3})
    await asyncio.sleep(0.25)  # alive thanks to the heartbeat
    assert await index.lookup([1, 2, 3]) == {"r0": 3}
    [record] = await index.live_replicas()
    assert (
        record.replica_id == "r0" and record.load("num_running") == 3 and 0 < record.heartbeat_ttl_ms <= 400
    )
    await asyncio.sleep(0.6)  # no heartbeat: expired
    assert await index.live_replicas() == []
    assert await index.lookup([1, 2, 3]) == {}
    assert not await index.heartbeat("r0", inc, ttl_s=0.4)


async def test_deregister_is_immediate(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", inc, [stored([5, 6], 2)])
    assert await index.deregister("r0", inc)
    assert await index.lookup([5, 6]) == {}
    assert await index.live_replicas() == []


async def test_resync_after_a_lost_batch(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    chain = list(range(100, 200))
    await index.publish("r0", inc, [stored(chain, 50)])
    # The batch storing 150..199 and removing 130..149 is lost (connection dropped).
    held = set(chain[:30]) | set(chain[50:])
    assert (await index.snapshot())["r0"] != held
    inc2 = await index.register("r0", "a:1", ttl_s=30)
    assert await index.publish_all("r0", inc2, dict.fromkeys(held, chain[0]))
    assert (await index.snapshot())["r0"] == held


async def test_lookup_is_one_round_trip(redis_index, redis_server):
    index = redis_index
    inc = await index.register("r0", "a:1", ttl_s=30)
    chain = list(range(1000, 1128))
    await index.publish("r0", inc, [stored(chain, 128)])
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
                ev = stored(chain, n)
                held.update(chain[:n])
            else:
                ev = removed(chain, n - 1)
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


async def test_sweep_removes_entries_of_dead_incarnations(redis_index):
    index = redis_index
    chain = list(range(1, 1301))
    old = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", old, [stored(chain, 1300)])
    other = await index.register("r1", "b:1", ttl_s=30)
    await index.publish("r1", other, [stored(chain, 10)])
    await index.register("r0", "a:1", ttl_s=30)  # r0 restarted: 1300 stale entries
    gone = 0
    for _ in range(20):  # 500 keys a step: the whole index well within 20 steps
        gone += await index.sweep()
    assert gone == 1300  # bits of r0's old slot cleared
    assert await index.lookup(chain[:10]) == {"r1": 10}
    keys = [k async for k in index.client.scan_iter(match=index.tag(chain[0]) + b"*")]
    assert len(keys) == 10  # emptied bitmaps are deleted


async def test_cluster_settings_are_stored_once_and_enforced(redis_server):
    a = RedisPrefixIndex.from_url(redis_server.url, "settings-model", 16, 42)
    await a.ensure_settings()
    await a.ensure_settings()  # same settings: fine
    for wrong in (
        RedisPrefixIndex.from_url(redis_server.url, "settings-model", 32, 42),
        RedisPrefixIndex.from_url(redis_server.url, "settings-model", 16, 43),
    ):
        with pytest.raises(IndexSettingsError, match="the index has"):
            await wrong.ensure_settings()
        await wrong.close()
    await a.close()


async def test_library_reloads_after_server_lost_it(redis_index):
    index = redis_index
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.client.function_flush()  # what a restarted server without persistence looks like
    assert await index.publish("r0", inc, [stored([1], 1)])
    assert await index.lookup([1]) == {"r0": 1}


async def test_hashes_use_the_full_64_bits(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    chain = [2**64 - 1, 0, 2**63]
    await index.publish("r0", inc, [stored(chain, 3)])
    assert await index.lookup(chain) == {"r0": 3}
    assert (await index.snapshot())["r0"] == set(chain)


async def test_lookup_bisection_with_every_replica_at_a_different_depth(index):
    rng = random.Random(11)
    chain = [rng.getrandbits(64) for _ in range(128)]
    holdings = {}
    for r in range(40):
        rid = f"r{r}"
        inc = await index.register(rid, "h:1", ttl_s=30)
        n = rng.randint(1, 128)
        await index.publish(rid, inc, [stored(chain, n)])
        holdings[rid] = set(chain[:n])
    for n in (1, 2, 3, 17, 64, 127, 128):
        assert await index.lookup(chain[:n]) == expected_depths(chain[:n], holdings)


async def test_retire_ends_the_current_incarnation(index):
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", inc, [stored([7, 8], 2)])
    assert await index.retire("r0")
    assert await index.lookup([7, 8]) == {} and await index.live_replicas() == []
    assert not await index.heartbeat("r0", inc, ttl_s=30)
    assert not await index.retire("nobody")


async def test_a_replica_that_restarted_counts_from_its_first_lookup(redis_server):
    """A router's client maps slots to live incarnations from records it read a while ago; an
    incarnation newer than any it read makes it read them again, so a resync is never missed."""
    chain = list(range(1, 9))
    replica = RedisPrefixIndex.from_url(redis_server.url, "restart-model", 16, 1)
    router = RedisPrefixIndex.from_url(redis_server.url, "restart-model", 16, 1, members_max_age_s=3600)
    old = await replica.register("r0", "a:1", ttl_s=30)
    await replica.publish("r0", old, [stored(chain, 8)])
    assert await router.lookup(chain) == {"r0": 8}
    new = await replica.register("r0", "a:1", ttl_s=30)
    await replica.publish("r0", new, [stored(chain, 5)])
    assert await router.lookup(chain) == {"r0": 5}
    await replica.close()
    await router.close()


async def test_speculation_expires_by_itself_and_counts_only_live_replicas(index):
    chain = list(range(50, 60))
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.register("r1", "b:1", ttl_s=30)
    await index.publish("r0", inc, [stored(chain, 4)])
    router = await index.register_router(ttl_s=30)
    assert await index.speculate(router, [("r1", chain[0], chain), ("gone", chain[0], chain)], ttl_s=0.3)
    view = await index.routing_view(chain)
    assert view.matched == {"r0": 4} and view.speculative == {"r1": 10}
    await asyncio.sleep(0.65)  # one to two TTLs: gone by itself
    assert (await index.routing_view(chain)).speculative == {}


@pytest.mark.bench  # `kvmesh bench index`'s hot-prefix hour, compressed: make test-bench
async def test_a_hot_prefix_stays_cheap_for_an_hour_of_buckets(valkey_server):
    """4 routers x 8 replicas on one hot 32-block chain for an hour of 2 s speculation buckets
    (compressed), in a 100k-entry index, replicas restarting now and then, sweeps at their real
    rate (each replica every 5 s): every block's holders stay one bit per live or recently dead
    replica, published or speculated, and the decision lists every holder at full depth. The same
    run as ``kvmesh bench index``'s hot-prefix row, which compares the decision's server time at
    the start and the end (a timing, so a benchmark's, not a test's)."""
    from kvmesh.bench.index import hot_prefix_hour

    def client() -> RedisPrefixIndex:
        return RedisPrefixIndex.from_url(valkey_server.url, "hot-model", 16, 1)

    index, sweepers = client(), [client() for _ in range(8)]  # a sweeper per replica
    hour = await hot_prefix_hour(index, sweepers)
    view, replicas = hour["view"], hour["replicas"]
    assert view.matched == dict.fromkeys(replicas, 32) and view.speculative == dict.fromkeys(replicas, 32)
    for key in hour["keys"]:  # one bit per live replica; the restarted ones' old bits swept
        assert len(replicas) <= await index.client.bitcount(key) <= len(replicas) + 1  # the last: not yet
        # as wide as the live slots plus those dead within the (real-time) quarantine
        assert await index.client.strlen(key) <= -(-(len(replicas) + hour["restarts"]) // 8)
    hot_tag = hour["keys"][0][: len(index.tag(0))]  # every tag is as long
    speculative = [k async for k in index.client.scan_iter(match=hot_tag + b"~*", count=10_000)]
    assert speculative, "the routers' speculation is stored"
    for key in speculative:  # the speculative bitmaps: as wide as the published ones, whatever the hour
        assert await index.client.strlen(key) <= -(-(len(replicas) + hour["restarts"]) // 8)
    assert hour["start_usec"] > 0 and hour["end_usec"] > 0  # measured (the bench row compares them)
    await index.client.flushall()
    for c in (index, *sweepers):
        await c.close()


@pytest.mark.parametrize("blocks", [2**14, 2**17])
async def test_prompts_of_any_length(index, blocks):
    chain = list(range(1, blocks + 1))
    a = await index.register("r0", "a:1", ttl_s=60)
    b = await index.register("r1", "b:1", ttl_s=60)
    await index.publish_all("r0", a, dict.fromkeys(chain, chain[0]))
    await index.publish_all("r1", b, dict.fromkeys(chain[: blocks // 2 + 1], chain[0]))
    router = await index.register_router(ttl_s=60)
    assert await index.speculate(router, [("r1", chain[0], chain)], ttl_s=60)
    view = await index.routing_view(chain)
    assert view.matched == {"r0": blocks, "r1": blocks // 2 + 1} and view.speculative == {"r1": blocks}


async def test_two_releases_share_one_server(redis_index):
    """A rolling upgrade: the previous release's library (kvmesh_index_v1, loaded with REPLACE
    by its clients) and this one's stay side by side, each client calling its own functions."""
    from pathlib import Path

    index = redis_index
    old_library = (Path(__file__).resolve().parents[1] / "data" / "index_v1.lua").read_text()
    await index.client.function_load(old_library, replace=True)  # an old client starts
    inc = await index.register("r0", "a:1", ttl_s=30)  # this release loads its own
    await index.publish("r0", inc, [stored([1, 2], 2)])
    await index.client.function_load(old_library, replace=True)  # the old client again
    old_ns = "{k:old}"
    old_inc = await index.client.fcall("kvmesh_register", 0, old_ns, "r0", 30000, "address", "a:0")
    assert await index.client.fcall("kvmesh_publish", 0, old_ns, "r0", old_inc, "+", bytes(8)) == 1
    assert await index.lookup([1, 2]) == {"r0": 2}
    libraries = {
        dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"].decode()
        for lib in await index.client.function_list()
    }
    assert {"kvmesh_index_v1", f"kvmesh_index_{VERSION}"} <= libraries


async def test_an_index_that_fills_its_memory_forgets_cold_prefixes_not_replicas(tmp_path):
    """The chart's policy (allkeys-lfu) on a server far too small for what is published: the
    replicas, their slots and the settings stay (touched by every heartbeat), the hot chain
    stays (read by every decision), cold block entries are evicted."""
    from kvmesh.cluster.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lfu"]) as server:
        index = RedisPrefixIndex.from_url(server.url, "full-model", 16, 1)
        await index.ensure_settings()
        rng = random.Random(3)
        hot = [rng.getrandbits(64) for _ in range(16)]
        incs = {f"r{r}": await index.register(f"r{r}", f"h:{r}", ttl_s=30) for r in range(4)}
        for rid, inc in incs.items():
            await index.publish("r0" if rid == "r0" else rid, inc, [stored(hot, 16)])
        for _ in range(12):  # ~190k cold entries: several times the memory
            for rid, inc in incs.items():
                cold = [rng.getrandbits(64) for _ in range(4000)]
                await index.publish_all(rid, inc, {h: h for h in cold})
                assert await index.heartbeat(rid, inc, ttl_s=30)
            assert (await index.routing_view(hot)).matched == dict.fromkeys(incs, 16)
        info = await index.client.info()
        assert info["evicted_keys"] > 0
        assert await index.has_settings()
        assert {r.replica_id: r.slot for r in await index.live_replicas()} == {f"r{r}": r for r in range(4)}
        assert await index.register("r4", "h:4", ttl_s=30) > max(incs.values())  # the counter survived
        await index.close()


async def test_clearing_a_bit_never_creates_or_widens_a_key(redis_index):
    """A removal of a block the server no longer has (evicted, swept) creates nothing, and a
    sweep clearing a high dead slot does not widen the bitmaps it visits."""
    index, chain = redis_index, [1, 2]
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", inc, [removed(chain, 0)])
    assert not await index.client.exists(index.block_key(chain[0], chain[0]))
    for r in range(1, 12):  # slots 1..11; r0 holds slot 0
        await index.register(f"r{r}", "b:1", ttl_s=30)
    await index.publish("r0", inc, [stored(chain, 2)])
    await index.register("r11", "b:1", ttl_s=30)  # slot 11 dies
    for _ in range(3):
        await index.sweep()
    assert await index.client.strlen(index.block_key(chain[0], chain[0])) == 1


async def test_a_router_without_speculation_never_divides_by_its_zero_ttl():
    from kvmesh.router.shared_load import FleetLoad

    fleet = FleetLoad(MemoryPrefixIndex(), speculative_ttl_s=0.0)
    fleet.speculate("r0", [1, 2, 3])  # a TTL of 0 turns speculation off
    assert fleet.unsent("r0").requests == 0


async def test_the_functions_refuse_records_and_reservations_that_would_break_decisions(redis_index):
    """A client that writes num_running=nan, an address that is not host:port, or an infinite
    reservation is refused by the index functions, with the field named."""
    index = redis_index
    with pytest.raises(redis.exceptions.ResponseError, match="address is not host:port"):
        await index.register("r0", "not an address", ttl_s=30)
    for text in ("hardware", "engine"):
        with pytest.raises(redis.exceptions.ResponseError, match=f"{text} is longer than 64 bytes"):
            await index.register("r0", "a:1", ttl_s=30, info={text: "x" * 65})
    inc = await index.register("r0", "a:1", ttl_s=30, info={"engine": "vllm", "hardware": "cpu/vllm"})
    for bad in ("nan", "inf", "-inf", "many"):
        with pytest.raises(redis.exceptions.ResponseError, match="num_running is not a finite number"):
            await index.heartbeat("r0", inc, ttl_s=30, load={"num_running": bad})
    router = await index.register_router(ttl_s=30)
    with pytest.raises(redis.exceptions.ResponseError, match="reservation is not a finite number"):
        await index.reserve(router, {"r0|n": float("nan")})
    assert await index.heartbeat("r0", inc, ttl_s=30, load={"num_running": 3})
    [record] = await index.live_replicas()
    assert record.load("num_running") == 3 and (await index.routing_view([])).fleet == {}


def test_a_record_never_fails_a_decision_by_what_it_holds():
    """What a router reads from a shared server is parsed defensively: a field that is not a
    finite number reads as the default."""
    from kvmesh.kvcache.index.api import ReplicaRecord

    fields = {"num_running": "nan", "num_waiting": "inf", "tokens_per_s": "fast", "num_blocks": "64"}
    record = ReplicaRecord("r0", "a:1", 1, 1000, fields)
    assert [record.load(k) for k in ("num_running", "num_waiting", "tokens_per_s", "missing")] == [0.0] * 4
    assert record.load("num_blocks") == 64.0 and record.load("missing", 7.0) == 7.0
