"""The index's two tiers, on both implementations: which replicas hold a chain's blocks on
the device and which on the host, and ``routing_view``'s depth counting both, in the same
one call. A replica's device blocks are closed under parents, and so are its device and host
blocks together (the block ledger keeps both): the reference below walks a chain block by
block, so it would see any depth the bisection gets wrong."""

import random

import pytest
from index_cases import expected_depths, host_removed, host_stored, stored

from kvmesh.kvcache.events import HOST

pytestmark = pytest.mark.servers  # the Redis half starts a server


async def test_routing_view_counts_host_blocks_that_continue_a_device_prefix(index):
    chain = list(range(1, 13))
    a = await index.register("a", "h:1", ttl_s=30)  # device 0..3, host 3..9: 9 with the host
    b = await index.register("b", "h:2", ttl_s=30)  # device 0..5, no host tier
    c = await index.register("c", "h:3", ttl_s=30)  # host only, 0..7 (its device evicted it all)
    await index.publish("a", a, [stored(chain, 3), host_stored(chain, 9, 3)])
    await index.publish("b", b, [stored(chain, 5)])
    await index.publish("c", c, [host_stored(chain, 7)])
    view = await index.routing_view(chain)
    assert view.matched == {"a": 3, "b": 5}
    assert view.tiered == {"a": 9, "b": 5, "c": 7}
    assert await index.lookup(chain) == {"a": 3, "b": 5}  # lookup stays the device tier's
    # the host drops a's tail 6..9; c's chain leaves its host tier
    await index.publish("a", a, [host_removed(chain, 6, 9)])
    await index.publish("c", c, [host_removed(chain, 0, 7)])
    view = await index.routing_view(chain)
    assert view.tiered == {"a": 6, "b": 5} and view.matched == {"a": 3, "b": 5}
    assert (await index.snapshot(HOST)) == {"a": set(chain[3:6]), "b": set(), "c": set()}


async def test_tiered_depths_match_the_reference_on_random_tiers(index):
    """Replicas at every mix of device depth and host continuation, speculation beside them:
    every query's three answers equal a block-by-block walk."""
    rng = random.Random(5)
    chains = [[rng.getrandbits(64) for _ in range(48)] for _ in range(3)]
    device: dict[str, set[int]] = {}
    either: dict[str, set[int]] = {}
    for r in range(24):
        rid = f"r{r}"
        inc = await index.register(rid, f"h:{r}", ttl_s=30)
        device[rid], either[rid] = set(), set()
        for chain in rng.sample(chains, 2):
            on_device = rng.randint(0, 48)
            on_host = rng.randint(on_device, 48)
            events = [stored(chain, on_device)] if on_device else []
            if on_host > on_device:  # the host holds its continuation, and some of its device blocks
                events.append(host_stored(chain, on_host, rng.randint(0, on_device)))
            await index.publish(rid, inc, events)
            device[rid] |= set(chain[:on_device])
            either[rid] |= set(chain[:on_host])
    router = await index.register_router(ttl_s=30)
    await index.speculate(router, [("r0", chains[0][0], chains[0][:20])], ttl_s=30)
    for chain in chains:
        for q in (chain, chain[:1], chain[:17], chain[:30] + [rng.getrandbits(64)] * 4):
            view = await index.routing_view(q)
            assert view.matched == expected_depths(q, device)
            assert view.tiered == expected_depths(q, either)
            assert view.speculative == (
                {"r0": min(20, len(q))} if chain is chains[0] and q[0] == chain[0] else {}
            )


async def test_a_resync_publishes_both_tiers(index):
    chain = list(range(40, 52))
    inc = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", inc, [stored(chain, 2), host_stored(chain, 12)])
    again = await index.register("r0", "a:1", ttl_s=30)  # a new incarnation starts empty
    assert (await index.routing_view(chain)).tiered == {}
    assert await index.publish_all(
        "r0", again, dict.fromkeys(chain[:4], chain[0]), host=dict.fromkeys(chain[4:10], chain[0])
    )
    view = await index.routing_view(chain)
    assert view.matched == {"r0": 4} and view.tiered == {"r0": 10}
    assert (await index.snapshot(HOST))["r0"] == set(chain[4:10])


async def test_a_sweep_clears_a_dead_slots_host_bits(redis_index):
    index = redis_index
    chain = list(range(1, 31))
    old = await index.register("r0", "a:1", ttl_s=30)
    await index.publish("r0", old, [stored(chain, 10), host_stored(chain, 30, 10)])
    await index.register("r0", "a:1", ttl_s=30)  # restarted: 30 stale entries, 20 on the host
    gone = 0
    for _ in range(1000):  # a step scans 500 of the server's keys: other tests' keys may come first
        gone += await index.sweep()
        if gone >= 30:
            break
    assert gone == 30
    assert [k async for k in index.client.scan_iter(match=index.tag(chain[0]) + b"*")] == []
