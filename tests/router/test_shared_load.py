"""Many routers, one view of the load: every router's in-flight work on each replica is kept in
the index next to the prefix entries, returned by the same call as the lookup, released at
the first token and the end, and taken back when a router dies (its heartbeat's TTL)."""

import asyncio
import collections
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from helpers import eventually, local_router_config

from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache.index.api import FleetWork, load_field
from kvmesh.kvcache.index.redis import RedisPrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.process import RouterServer
from kvmesh.router.shared_load import FleetLoad
from kvmesh.serving.metrics import read_samples

KVMESH = str(Path(sys.executable).with_name("kvmesh"))

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]


# ---------------------------------------------------------------------- the index alone


async def test_reservations_add_up_release_and_die_with_their_router(redis_server):
    index = RedisPrefixIndex.from_url(redis_server.url, "shared-load-index", 16, 0)
    await index.ensure_settings()
    a, b = await index.register_router(ttl_s=30), await index.register_router(ttl_s=0.3)
    assert await index.reserve(
        a, {load_field("r0", "n"): 2, load_field("r0", "p"): 8.5, load_field("r0", "d"): 1}
    )
    assert await index.reserve(
        b, {load_field("r0", "n"): 1, load_field("r1", "n"): 3, load_field("r1", "d"): 0.25}
    )
    fleet = (await index.routing_view([])).fleet
    assert fleet == {"r0": FleetWork(3, 8.5, 1), "r1": FleetWork(3, 0, 0.25)}
    assert await index.reserve(a, {load_field("r0", "p"): -8.5})  # a's first token
    await asyncio.sleep(0.5)  # b stops heartbeating: its share goes at the next heartbeat of anyone
    assert not await index.reserve(b, {load_field("r1", "n"): 1})  # a dead router adds nothing
    assert await index.router_heartbeat(a, 30)
    assert (await index.routing_view([])).fleet == {"r0": FleetWork(2, 0, 1)}
    assert await index.reserve(a, {load_field("r0", "n"): -2, load_field("r0", "d"): -1})
    assert (await index.routing_view([])).fleet == {}
    assert await index.client.hlen(f"{index.ns}load") == 0  # released fields leave, no float dust
    await index.deregister_router(a)
    await index.client.flushdb()
    await index.close()


async def test_fleet_load_sends_one_call_per_loop_turn_and_renews_after_a_flush(valkey_server):
    index = RedisPrefixIndex.from_url(valkey_server.url, "shared-load-fleet", 16, 0)
    await index.ensure_settings()
    await index.register_router(ttl_s=30)  # another router: there is someone to share with
    fleet = FleetLoad(index, heartbeat_s=0.1, ttl_s=2.0)
    await fleet.start()
    assert fleet.active
    fleet.add("r0", 1, 4, 2)
    fleet.add("r0", 1, 4, 2)
    assert fleet.unsent("r0") == FleetWork(2, 8, 4)  # not in the index yet: the caller adds it
    await asyncio.sleep(0.05)
    assert fleet.unsent("r0") == FleetWork(0, 0, 0)
    assert (await index.routing_view([])).fleet == {"r0": FleetWork(2, 8, 4)}
    await index.client.flushall()  # Redis lost everything: the heartbeat re-registers, re-reserves
    assert await eventually(lambda: _fleet_is(index, {"r0": FleetWork(2, 8, 4)}), timeout=5)
    fleet.add("r0", -2, -8, -4)
    await fleet.stop()
    assert (await index.routing_view([])).fleet == {}
    await index.close()


async def test_a_stop_that_cuts_a_renewal_short_still_takes_its_reservations_back(valkey_server):
    """The stop lands after a renewal reserved what the router holds but before the renewal
    counted the routers: the new incarnation's share goes with the stop, not with its TTL."""
    index = RedisPrefixIndex.from_url(valkey_server.url, "shared-load-cut", 16, 0)
    await index.ensure_settings()
    fleet = FleetLoad(index, heartbeat_s=0.05, ttl_s=30.0)
    await fleet.start()
    fleet.add("r0", 1, 4, 2)
    renewing, counted = asyncio.Event(), index.router_heartbeat

    async def heartbeat_that_hangs_once_reserved(incarnation: int, ttl_s: float) -> int:
        if await index.client.hlen(f"{index.ns}load"):  # the renewal's reservation landed
            renewing.set()
            await asyncio.Event().wait()  # the stop cancels it here
        return await counted(incarnation, ttl_s)

    index.router_heartbeat = heartbeat_that_hangs_once_reserved  # fault: the renewal stalls
    await index.client.flushall()  # Redis lost everything: the next heartbeat renews
    await asyncio.wait_for(renewing.wait(), timeout=5)
    assert (await index.routing_view([])).fleet == {"r0": FleetWork(1, 4, 2)} and fleet.incarnation is None
    await fleet.stop()
    assert (await index.routing_view([])).fleet == {}
    await index.close()


async def test_a_lone_router_shares_nothing_until_another_router_registers(valkey_server):
    index = RedisPrefixIndex.from_url(valkey_server.url, "shared-load-alone", 16, 0)
    await index.ensure_settings()
    fleet = FleetLoad(index, heartbeat_s=0.1, ttl_s=2.0)
    await fleet.start()
    assert fleet.alone and not fleet.active  # the decision reads this router's own counts
    fleet.add("r0", 1, 4, 2)
    fleet.add("r1", 1, 4, 2)
    fleet.add("r1", -1, -4, -2)
    await asyncio.sleep(0.3)  # three heartbeats: still alone, nothing sent per request
    assert fleet.alone and (await index.routing_view([])).fleet == {}
    other = await index.register_router(ttl_s=30)
    # Within a heartbeat it re-registers holding exactly what it has in flight, then shares.
    assert await eventually(lambda: _fleet_is(index, {"r0": FleetWork(1, 4, 2)}), timeout=5)
    assert fleet.active
    fleet.add("r0", -1, -4, -2)
    assert await eventually(lambda: _fleet_is(index, {}), timeout=5)
    await index.deregister_router(other)
    assert await eventually(lambda: asyncio.sleep(0, result=fleet.alone), timeout=5)
    await fleet.stop()
    await index.close()


async def _fleet_is(index: RedisPrefixIndex, wanted: dict) -> bool:
    try:
        return (await index.routing_view([])).fleet == wanted
    except Exception:
        return False


# ---------------------------------------------------------------------- routers


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet_of_routers(qwen3_dir):
    redis = EmbeddedRedis().start()
    engine = EngineConfig(num_kv_blocks=256, block_size=16, max_model_len=4096)
    replicas = [
        ReplicaServer(ReplicaConfig(str(qwen3_dir), f"shared-{i}", redis.url, http_port=-1, engine=engine))
        for i in range(2)
    ]
    for r in replicas:
        await r.start()
    routers = {}
    for name, shared in (("a", "on"), ("b", "on"), ("off", "off")):
        routers[name] = RouterServer(
            local_router_config(qwen3_dir, redis.url, http_port=-1, shared_load=shared)
        )
        if routers[name].registry.fleet is not None:
            routers[name].registry.fleet.heartbeat_s, routers[name].registry.fleet.ttl_s = (
                0.2,
                1.0,
            )  # die fast in this test
        await routers[name].start()
    for router in routers.values():
        assert await eventually(lambda r=router: asyncio.sleep(0, result=len(r.registry.live()) == 2))
    for name in ("a", "b"):  # each has seen the other (a heartbeat): both share every request
        assert await eventually(
            lambda f=routers[name].registry.fleet: asyncio.sleep(0, result=f.active), timeout=10
        )
    yield {"routers": routers, "redis": redis}
    for router in routers.values():
        await router.stop(grace=0.5)
    for r in replicas:
        await r.stop(grace=0.5)
    redis.close()


async def _long_requests(router: RouterServer, n: int) -> list[asyncio.Task]:
    """``n`` requests streaming through ``router`` until cancelled."""
    channel = grpc.aio.insecure_channel(router.address)
    stub = pb_grpc.RouterStub(channel)

    async def one(i: int) -> str:
        try:
            return await _long_stream(stub, 7 + i)
        finally:
            await channel.close()

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    assert await eventually(lambda: asyncio.sleep(0, result=_local(router) == n))
    return tasks


async def _long_stream(stub: pb_grpc.RouterStub, token: int) -> str:
    """A 3,000-token generation to its end: "OK", or the status code that ended it."""
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[token] * 40), sampling=pb.SamplingParams(max_tokens=3000, ignore_eos=True)
    )
    try:
        async for _ in stub.Generate(req, timeout=120):
            pass
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


def _local(router: RouterServer) -> int:
    return sum(e.load.requests for e in router.registry.entries.values())


async def _seen_by(router: RouterServer) -> int:
    """In-flight requests the router's policy sees on all replicas, as it decides now."""
    view = await router.core.decider.lookup([])
    return sum(s.inflight_requests for s in router.registry.states({}, view.fleet))


async def _stop(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_every_router_sees_the_fleets_in_flight_work(fleet_of_routers):
    a, b, off = (fleet_of_routers["routers"][k] for k in ("a", "b", "off"))
    tasks = await _long_requests(a, 4)
    try:
        assert await eventually(lambda: _equals(_seen_by(b), 4))
        assert await _seen_by(off) == 0  # --shared-load off: its own counts only
        per_replica = {e.record.replica_id: e.load.requests for e in a.registry.entries.values()}
        fleet = (await b.core.decider.lookup([])).fleet
        assert {rid: round(w.requests) for rid, w in fleet.items()} == {
            k: v for k, v in per_replica.items() if v
        }
        assert await eventually(lambda: _prefill_released(b))  # every first token out: prefill released
    finally:
        await _stop(tasks)
    assert await eventually(lambda: _equals(_seen_by(b), 0))  # released at the end
    samples = read_samples(a.core.render_metrics().decode())
    synced, took = (
        samples[("kvmesh_router_fleet_sync_seconds_count", ())],
        samples[("kvmesh_router_fleet_sync_seconds_sum", ())],
    )
    # The race window is measured (how short it is is a benchmark's business, not a unit test's:
    # one stall of a busy 2-core machine made an average of 8 batches 61 ms in CI).
    assert synced >= 2 and took > 0


async def test_a_routers_hand_off_claims_take_room_from_every_other_routers_view(fleet_of_routers):
    """Slots a router keeps for its waiting requests (flow control's claims) reach the other
    routers through the index, and their saturation check counts them against the room."""
    a, b = (fleet_of_routers["routers"][k] for k in ("a", "b"))
    room = sum(e.record.load("max_num_seqs") for e in b.registry.live())
    assert room and not await b.core.saturated()
    a.core.flow.on_claims(int(room))  # as the hook is called: every slot claimed
    try:
        assert await eventually(lambda: b.core.saturated(), timeout=5)
        assert not await a.core.saturated()  # its own claims are its own to fill
    finally:
        a.core.flow.on_claims(-int(room))
    assert await eventually(lambda: _not(b.core.saturated()), timeout=5)
    assert await _fleet_is(b.core.decider.index, {})  # nothing left behind in the index


async def _not(check) -> bool:
    return not await check


async def test_a_prompt_without_a_full_block_is_routed_without_a_prefix_lookup(fleet_of_routers):
    """Nothing to look up: a router on its own counts makes no index call; a sharing one
    reads only the fleet's work (one HGETALL)."""
    off, a = fleet_of_routers["routers"]["off"], fleet_of_routers["routers"]["a"]

    def lookups(router: RouterServer) -> float:
        return read_samples(router.core.render_metrics().decode())[
            ("kvmesh_router_index_lookup_seconds_count", ())
        ]

    short = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 15), sampling=pb.SamplingParams(max_tokens=1))
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 40), sampling=pb.SamplingParams(max_tokens=1))
    before = lookups(off)
    assert (await off.core.decide(short)).index_read
    assert lookups(off) == before  # block size 16: no full block, no call
    await off.core.decide(long)
    assert lookups(off) == before + 1
    # What router a sends, recorded on its way out (the server's command counts also see
    # the other routers' and this router's own membership reads, which run when they are due).
    sent: list[tuple] = []
    pipeline = a.index._pipeline

    async def recorded(commands):
        sent.extend(commands)
        return await pipeline(commands)

    a.index._pipeline = recorded
    try:
        decision = await a.core.decide(short)
    finally:
        del a.index._pipeline
    assert decision.index_read and [command[0] for command in sent] == ["hgetall"]


async def test_a_dead_routers_reservations_end_with_its_heartbeat(fleet_of_routers):
    a, b = fleet_of_routers["routers"]["a"], fleet_of_routers["routers"]["b"]
    tasks = await _long_requests(a, 3)
    try:
        assert await eventually(lambda: _equals(_seen_by(b), 3))
        await a.registry.fleet._loops.stop()  # the fault: router a stops talking to the index, holding 3
        a.registry.fleet.incarnation = None
        assert await eventually(lambda: _equals(_seen_by(b), 0), timeout=5)  # its TTL is 1 s here
    finally:
        await _stop(tasks)
        await a.registry.fleet.start()  # a comes back: a new incarnation holding what it has (nothing)
    assert await eventually(lambda: _equals(_seen_by(a), 0))


async def test_a_router_process_killed_leaks_nothing_and_its_clients_are_told(fleet_of_routers, qwen3_dir):
    """SIGKILL a real router process holding 3 streams: its clients get UNAVAILABLE (no hang),
    its replicas free the work, the other routers see its share gone within its heartbeat TTL,
    and they keep serving."""
    a, redis = fleet_of_routers["routers"]["a"], fleet_of_routers["redis"]
    port = _free_port()
    proc = subprocess.Popen(
        [
            KVMESH,
            "router",
            "--model",
            str(qwen3_dir),
            "--redis-url",
            redis.url,
            "--port",
            str(port),
            "--http-port",
            "-1",
            "--block-size",
            "16",
            "--registry-refresh",
            "0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RouterStub(channel)
            assert await eventually(lambda: _serves(stub), timeout=60), (
                proc.stderr.read() if proc.poll() else ""
            )

            tasks = [asyncio.create_task(_long_stream(stub, 30 + i)) for i in range(3)]
            assert await eventually(lambda: _equals(_seen_by(a), 3))  # its work, seen by another router
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            codes = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert codes == ["UNAVAILABLE"] * 3, codes  # told at once, no hang
        assert await eventually(lambda: _equals(_seen_by(a), 0), timeout=10)  # reaped: TTL 5 s
        reaped_after = time.monotonic() - killed
        assert reaped_after < 5.0 + 1.0 + 1.0, reaped_after  # its TTL + a heartbeat + a refresh
        index = a.index
        assert await index.client.hlen(f"{index.ns}load") == 0
        assert await eventually(lambda: _replicas_idle(a))  # the replicas dropped its streams
        tasks = await _long_requests(a, 2)  # and the fleet keeps serving
        await _stop(tasks)
    finally:
        proc.kill()
        proc.wait()


async def _serves(stub) -> bool:
    try:
        replicas = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=2)
        return len(replicas.replicas) == 2
    except grpc.aio.AioRpcError:
        return False


async def _replicas_idle(router: RouterServer) -> bool:
    async with grpc.aio.insecure_channel(router.address) as channel:
        replicas = await pb_grpc.RouterStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=5)
    return all(r.num_running == 0 and r.num_waiting == 0 for r in replicas.replicas)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _prefill_released(router: RouterServer) -> bool:
    fleet = (await router.core.decider.lookup([])).fleet
    return all(w.prefill_blocks == 0 for w in fleet.values())


async def _equals(seen, wanted: int) -> bool:
    return await seen == wanted


async def test_speculative_entries_are_seen_by_every_router_and_expire(valkey_server):
    index = RedisPrefixIndex.from_url(valkey_server.url, "shared-load-speculation", 16, 0)
    await index.ensure_settings()
    router = await index.register_router(ttl_s=30)
    inc = await index.register("r0", "127.0.0.1:1", ttl_s=30)
    await index.register("r1", "127.0.0.1:2", ttl_s=30)
    await index.publish_all("r0", inc, {11: 11, 12: 11})
    assert await index.speculate(router, [("r1", 11, [11, 12, 13]), ("r0", 11, [11, 12, 13, 14])], ttl_s=0.3)
    view = await index.routing_view([11, 12, 13, 15])
    assert view.matched == {"r0": 2}  # published
    assert view.speculative == {"r1": 3, "r0": 3}
    assert await index.lookup([11, 12, 13]) == {"r0": 2}  # what replicas published, only
    await asyncio.sleep(0.7)  # ttl to twice ttl after its last use
    assert (await index.routing_view([11, 12, 13])).speculative == {}
    await index.deregister_router(router)
    assert not await index.speculate(router, [("r1", 11, [11])], ttl_s=0.3)  # told: register anew
    await index.client.flushdb()
    await index.close()


async def test_two_routers_ride_out_redis_away_and_the_fleet_counts_return_to_zero(fleet_of_routers):
    """Redis away 10 s (and back empty) under load through two sharing routers: every request
    is served (by local counts meanwhile), none hangs, both routers share again afterwards,
    and when the load stops the fleet's in-flight work is exactly zero."""
    a, b = fleet_of_routers["routers"]["a"], fleet_of_routers["routers"]["b"]
    redis = fleet_of_routers["redis"]
    stop, codes = asyncio.Event(), []

    async def client(router: RouterServer, k: int) -> None:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = pb_grpc.RouterStub(channel)
            i = 0
            while not stop.is_set():
                req = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[11 + k] * 32 + [i % 50 + 1] * 8),
                    sampling=pb.SamplingParams(max_tokens=8),
                )
                try:
                    async for _ in stub.Generate(req, timeout=30):
                        pass
                    codes.append("OK")
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code().name)
                i += 1

    clients = [asyncio.create_task(client(r, k)) for k, r in enumerate((a, b, a, b))]
    await asyncio.sleep(1.0)
    redis.stop()
    await asyncio.sleep(10.0)
    assert (
        not a.registry.fleet.active and not b.registry.fleet.active
    )  # routing on their own counts meanwhile
    redis.start()
    assert await eventually(
        lambda: asyncio.sleep(0, result=a.registry.fleet.active and b.registry.fleet.active), timeout=15
    )
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*clients), 60)  # nothing hangs
    assert len(codes) > 20 and set(codes) == {"OK"}, collections.Counter(codes)
    index = a.index
    assert await eventually(lambda: _fleet_is(index, {}), timeout=10)
    assert await index.client.hlen(f"{index.ns}load") == 0
