"""Any bytes in the index cost only their own entry (issue 48: one malformed record made every
request fail). Every role's functions can write only what the role may write raw, so each
defect here is one a router or replica user could cause; each test failed on the code before
the index read entries one at a time and its functions stopped trusting shared keys."""

import pytest

from kvmesh.kvcache import BlockStored
from kvmesh.kvcache.index.redis import RedisPrefixIndex

pytestmark = pytest.mark.servers

CHAIN = [101, 102, 103]


@pytest.fixture
def index(redis_index):
    """The server's index only: what these tests write is raw Redis."""
    return redis_index


async def two_replicas(index: RedisPrefixIndex) -> dict[str, int]:
    incarnations = {}
    for rid, port in (("r0", 5000), ("r1", 5001)):
        incarnations[rid] = inc = await index.register(rid, f"127.0.0.1:{port}", ttl_s=30)
        await index.publish(rid, inc, [BlockStored(tuple(CHAIN), None, 16, CHAIN[0])])
    return incarnations


@pytest.mark.parametrize(
    "field, value, skipped",
    [
        ("slot", "x", 1),  # int() of it failed every request
        ("model_id", b"\xff\xfe", 1),  # not UTF-8
        ("address", "attacker.example:80 extra", 1),
        ("slot", "99999", 1),  # past every bitmap
        ("incarnation", "1e999", 0),  # no live incarnation has that number: not live, no error
        ("hardware", "H" * 100_000, 1),  # a metric label on every scrape
        ("hardware", "GPU\nforged log line", 1),
        ("replica_id", "r1 " + "x" * 200, 1),  # a label and a log field too
    ],
)
async def test_a_malformed_record_is_skipped_and_counted_and_the_others_serve(index, field, value, skipped):
    await two_replicas(index)
    await index.client.hset(f"{index.ns}r:r1", field, value)
    live = await index.live_replicas()
    assert [r.replica_id for r in live] == ["r0"]
    assert index.untrusted.skipped["record"] == skipped
    assert await index.lookup(CHAIN) == {"r0": 3}
    assert (await index.routing_view(CHAIN)).matched == {"r0": 3}


async def test_a_record_without_an_address_is_skipped(index):
    await two_replicas(index)
    await index.client.hdel(f"{index.ns}r:r0", "address")
    assert [r.replica_id for r in await index.live_replicas()] == ["r1"]


async def test_garbage_in_the_load_hash_is_skipped_and_reservations_repair_it(index):
    await two_replicas(index)
    rinc = await index.register_router(ttl_s=30)
    await index.client.hset(f"{index.ns}load", mapping={"r0": "garbage", "r1": "1 2 3", b"\xff": "nan 1 1"})
    view = await index.routing_view(CHAIN)
    assert set(view.fleet) == {"r1"} and view.fleet["r1"].prefill_blocks == 2
    assert index.untrusted.skipped["load"] == 2
    assert await index.share(rinc, {"r0|n": 1.0}, [], ttl_s=2)  # failed in Lua on the garbage
    assert (await index.routing_view(CHAIN)).fleet["r0"].requests == 1


async def test_garbage_in_a_routers_share_does_not_stop_the_reaping(index):
    await two_replicas(index)
    dead, live = await index.register_router(ttl_s=0.05), await index.register_router(ttl_s=30)
    assert await index.share(dead, {"r0|n": 2.0}, [], ttl_s=2)
    await index.client.hset(f"{index.ns}w{dead}", "r0|p", "garbage")
    await index.client.delete(f"{index.ns}ri{dead}")  # it died
    assert await index.router_heartbeat(live, ttl_s=30) == 1
    assert "r0" not in (await index.routing_view(CHAIN)).fleet


async def test_register_survives_a_broken_counter_and_ends_no_slot_when_refused(index):
    first = await two_replicas(index)
    await index.client.set(f"{index.ns}next", "x")  # INCR failed after the old slot had ended
    again = await index.register("r0", "127.0.0.1:5000", ttl_s=30)
    assert await index.heartbeat("r0", again, ttl_s=30) and not await index.heartbeat(
        "r0", first["r0"], ttl_s=30
    )
    assert sorted(r.replica_id for r in await index.live_replicas()) == ["r0", "r1"]
    assert await index.client.hlen(f"{index.ns}dead") == 1  # r0's previous slot, nothing burned
    slots_before = await index.client.hgetall(f"{index.ns}slots")
    with pytest.raises(Exception, match="host:port"):
        await index.register("r1", "not an address", ttl_s=30)
    assert await index.client.hgetall(f"{index.ns}slots") == slots_before


async def test_a_counter_set_back_takes_no_replicas_liveness_or_routers_share(index):
    first = await two_replicas(index)
    routers = {await index.register_router(ttl_s=30) for _ in range(2)}
    await index.client.set(f"{index.ns}next", 0)
    newcomer = await index.register("r2", "127.0.0.1:5002", ttl_s=30)
    assert newcomer in first.values()  # numbers repeat, but liveness is each replica's own key
    assert await index.register_router(ttl_s=30) not in routers  # a live router's number never
    assert sorted(r.replica_id for r in await index.live_replicas()) == ["r0", "r1", "r2"]
    for rid, inc in first.items():  # their liveness keys are still their own
        assert await index.heartbeat(rid, inc, ttl_s=30)


async def test_a_block_key_wider_than_any_slot_does_not_break_lookups(index):
    await two_replicas(index)
    await index.client.set(index.block_key(CHAIN[0], CHAIN[0]), b"\xff" * (1 << 20))
    assert await index.lookup(CHAIN) == {"r0": 3, "r1": 3}  # a Lua error on every lookup before


async def test_unreadable_settings_read_as_text_and_fail_the_check_with_a_reason(index):
    await index.client.hset(f"{index.ns}settings", "block_size", b"\xff")
    assert (await index.settings())["block_size"] == "\ufffd"
    with pytest.raises(Exception, match="block_size"):
        await index.ensure_settings()
