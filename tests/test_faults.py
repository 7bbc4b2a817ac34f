"""Faults under load, with real Ray, real Redis and real gRPC: a replica killed mid-flight,
Redis gone for 10 s, the router restarted, a slow replica. Every accepted request ends
as a success or a reported error; nothing is lost silently."""

import asyncio
import collections
import contextlib
import json
import time
import types

import grpc
import httpx
import pytest
import pytest_asyncio
import ray
from helpers import another_router, eventually, metric
from reference import prompts_of_lengths

from kvmesh.cluster.config import ClusterConfig
from kvmesh.cluster.launcher import LocalCluster
from kvmesh.kvcache.index.api import ReplicaRecord
from kvmesh.kvcache.index.redis import RedisPrefixIndex
from kvmesh.protos import pb, pb_grpc
from kvmesh.router import registry as registry_module
from kvmesh.router.registry import ReplicaRegistry
from kvmesh.router.replica_load import RequestWork

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(ray_cluster, qwen3_dir):
    config = ClusterConfig.for_model(
        str(qwen3_dir),
        3,
        engine={"num_kv_blocks": 512, "max_num_seqs": 32},
        router={"port": 0, "http_port": 0},
        # the product's TTL (a 1.5 s one lapsed on 2 cores under the full suite's load)
        replica={"heartbeat_s": 0.2, "ttl_s": 3.0},
    )
    async with LocalCluster(config) as c:
        c.supervisor.check_s = 0.3
        yield c


def request(salt: int, max_tokens: int = 40, policy: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = prompts_of_lengths([48], salt=salt)[0]
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling, policy=policy)


async def tracked(channel, req) -> dict:
    """One request's fate: ok, or the error code and whether it had started streaming."""
    chunks, replica = 0, ""
    try:
        async for r in pb_grpc.RouterStub(channel).Generate(req, timeout=120):
            if r.WhichOneof("kind") == "chunk":
                chunks += 1
            else:
                replica = r.complete.replica_id
        return {"code": "OK", "chunks": chunks, "replica": replica}
    except grpc.aio.AioRpcError as exc:
        return {"code": exc.code().name, "chunks": chunks, "details": exc.details()}


async def live(cluster) -> dict[str, int]:
    await cluster.router.registry.refresh()
    return {e.record.replica_id: e.record.incarnation for e in cluster.router.registry.live()}


async def index_equals_every_cache(cluster) -> bool:
    snapshot = await cluster.router.index.snapshot()
    for replica_id, actor in cluster.supervisor.actors.items():
        state = await actor.index_state.remote()
        cache = set(await actor.cached_hashes.remote())
        if state["dirty"] or snapshot.get(replica_id, set()) != cache:
            return False
    return True


async def test_kill_a_replica_with_50_requests_in_flight_through_two_routers(cluster, qwen3_dir):
    """Two routers sharing the fleet's load, a replica killed under them: nothing is lost
    silently, and when the load stops the fleet's in-flight work is back to exactly zero."""
    before = await live(cluster)
    victim = "replica-1"
    second = another_router(cluster, qwen3_dir, http_port=-1)
    await second.start()
    await eventually(lambda: _sees(second, 3))
    async with (
        grpc.aio.insecure_channel(cluster.router_address) as one,
        grpc.aio.insecure_channel(second.address) as two,
    ):
        tasks = [
            asyncio.create_task(tracked((one, two)[i % 2], request(i, max_tokens=80, policy="round_robin")))
            for i in range(50)
        ]
        await asyncio.sleep(0.6)  # some stream, some still wait in queues
        ray.kill(cluster.supervisor.actors[victim])
        results = await asyncio.gather(*tasks)
    codes = collections.Counter(r["code"] for r in results)
    # The queued ones were retried elsewhere, the streaming ones moved (a migration).
    assert codes == {"OK": 50}, [r for r in results if r["code"] != "OK"]
    assert all(r["chunks"] == 80 for r in results)  # one token a chunk: none repeated, none lost
    assert metric(cluster.router.core, "kvmesh_router_migrations_total", outcome="moved") >= 1
    index = cluster.router.index
    assert await eventually(lambda: _no_fleet_work(index), timeout=10)  # nothing reserved outlives the load
    await second.stop(grace=0.2)

    async def replaced():
        now = await live(cluster)
        return len(now) == 3 and now.get(victim, before[victim]) != before[victim]

    assert await eventually(replaced, timeout=60)  # retired at once, replaced with a new incarnation
    assert await eventually(lambda: index_equals_every_cache(cluster), timeout=30)  # no stale entries


async def _no_fleet_work(index: RedisPrefixIndex) -> bool:
    return (await index.routing_view([])).fleet == {} and await index.client.hlen(f"{index.ns}load") == 0


async def test_replica_channel_closed_mid_stream_moves_the_stream_at_once(cluster):
    """Closing a replica's channel cancels its calls. The router must still answer: letting
    the cancellation end its handler sends the client no status, so it waits out its deadline
    (seen in the soak when replicas left the index and their channels were closed). The
    stream goes on on another replica instead."""
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        call = pb_grpc.RouterStub(channel).Generate(request(7, max_tokens=400), timeout=60)
        first = await call.read()  # streaming: the router holds a call on one replica's channel
        replica_id = cluster.router.core.relay.inflight[first.request_id]
        entry = cluster.router.registry.entries.pop(replica_id)  # the next refresh re-adds it
        await entry.channel.close()
        start = time.monotonic()
        tokens = len(first.chunk.token_ids)
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.WhichOneof("kind") == "chunk":
                tokens += len(response.chunk.token_ids)
            else:
                complete = response.complete
    assert complete.replica_id != replica_id and tokens == 400 == complete.usage.completion_tokens
    assert time.monotonic() - start < 10


async def _all_back(cluster, replaced: str, before: int) -> bool:
    now = await live(cluster)
    return len(now) == 3 and now.get(replaced, before) != before


async def test_a_stream_whose_replica_is_killed_after_5_tokens_ends_with_the_same_greedy_tokens(cluster):
    """gRPC: the replica under a greedy stream is killed after its 5th token; the stream
    finishes on another replica with exactly the tokens of an uninterrupted run, the same
    request id, and usage counted once."""
    req = request(31, max_tokens=300)
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = pb_grpc.RouterStub(channel)
        whole = [r async for r in stub.Generate(req, timeout=60)]
        expected = [t for r in whole if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids]
        assert await eventually(lambda: asyncio.sleep(0, result=not cluster.router.core.relay.inflight))
        before = await live(cluster)
        call = stub.Generate(pb.GenerateRequest(request_id="mig-1", **_fields(req)), timeout=60)
        got, victim, responses = [], None, []
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
            got.extend(response.chunk.token_ids)
            if len(got) >= 5 and victim is None:
                (victim,) = cluster.router.core.relay.inflight.values()
                ray.kill(cluster.supervisor.actors[victim])
    complete = responses[-1].complete
    assert got == expected and complete.replica_id != victim, (len(got), len(expected))
    assert {r.request_id for r in responses} == {"mig-1"}
    assert complete.usage.prompt_tokens == 48 and complete.usage.completion_tokens == 300
    assert await eventually(lambda: _all_back(cluster, victim, before[victim]), timeout=60)


async def test_an_openai_stream_whose_replica_is_killed_after_5_tokens_reads_as_one_stream(cluster):
    """The same through the router's OpenAI port (the replica's own SSE relayed): one stream,
    the uninterrupted run's text, one role delta, one id, usage counted once."""
    body = {
        "messages": [{"role": "user", "content": "tell me a long story about a fox " * 4}],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as http:
        whole = await _chat_events(http, body)
        before = await live(cluster)
        victim = None

        def kill_after_5(events: list[dict]) -> None:
            nonlocal victim
            if (
                victim is None
                and sum(bool(e["choices"] and e["choices"][0]["delta"].get("content")) for e in events) >= 5
            ):
                (victim,) = cluster.router.core.relay.inflight.values()
                ray.kill(cluster.supervisor.actors[victim])

        moved = await _chat_events(http, body, kill_after_5)
    assert victim is not None
    text = [
        "".join(e["choices"][0]["delta"].get("content", "") for e in ev if e["choices"])
        for ev in (whole, moved)
    ]
    assert text[0] == text[1] and len(text[0]) > 0
    assert sum("role" in e["choices"][0]["delta"] for e in moved if e["choices"]) == 1
    assert len({e["id"] for e in moved}) == 1 and len({e["created"] for e in moved}) == 1
    usage = moved[-1]["usage"]
    assert usage["completion_tokens"] == 300 and usage["prompt_tokens"] == whole[-1]["usage"]["prompt_tokens"]
    assert await eventually(lambda: _all_back(cluster, victim, before[victim]), timeout=60)


async def _chat_events(http: httpx.AsyncClient, body: dict, each=None) -> list[dict]:
    """A streamed chat completion's events; ``each(events so far)`` after every one."""
    events, raw = [], b""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for data in response.aiter_bytes():
            raw += data
            while b"\n\n" in raw:
                event, raw = raw.split(b"\n\n", 1)
                assert event.startswith(b"data: "), event  # no router comment reaches a client
                if event != b"data: [DONE]":
                    events.append(json.loads(event[6:]))
                    if each is not None:
                        each(events)
    return events


def _fields(req: pb.GenerateRequest) -> dict:
    return {"token_ids": req.token_ids, "sampling": req.sampling, "policy": req.policy}


async def test_departed_replica_channel_closes_only_when_its_calls_are_done(valkey_server):
    index = RedisPrefixIndex.from_url(valkey_server.url, "retire-test", 16, 1)
    registry = ReplicaRegistry(index)
    record = ReplicaRecord("r0", "127.0.0.1:9", 1, heartbeat_ttl_ms=1000, fields={})
    await registry._apply([record])
    entry = registry.entries["r0"]
    work = RequestWork.estimate(4, 0, 8, 16)
    registry.begin(entry, work)
    await registry._apply([])  # r0 left the index while a call is on its channel
    assert "r0" not in registry.entries
    assert entry.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN  # the call keeps its channel
    registry.end(entry, work)
    await registry._apply([])
    assert entry.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
    await registry.stop()
    await index.close()


async def test_replicas_not_yet_back_in_a_returned_index_stay_for_a_heartbeat(valkey_server):
    """Redis came back empty and the settings were stored again before every replica had
    re-registered: the ones not listed yet must not drop out (a router saw "no live replica"
    in that window); one that never comes back leaves after its heartbeat TTL."""
    index = RedisPrefixIndex.from_url(valkey_server.url, "returning-index", 16, 1)
    await index.ensure_settings()
    for rid in ("r0", "r1"):
        await index.register(rid, f"127.0.0.1:{9 if rid == 'r0' else 10}", ttl_s=1.0)
    registry = ReplicaRegistry(index)
    await registry.refresh()
    assert {e.record.replica_id for e in registry.live()} == {"r0", "r1"}
    await index.client.flushall()
    await registry.refresh()
    assert registry.index_problem == "index lost its data" and len(registry.live()) == 2
    await index.ensure_settings()  # back: settings first, then r0 only
    await index.register("r0", "127.0.0.1:9", ttl_s=1.0)
    await registry.refresh()
    assert registry.index_ok and {e.record.replica_id for e in registry.live()} == {"r0", "r1"}
    await asyncio.sleep(1.2)  # r1's heartbeat TTL: it is gone for good
    await index.register("r0", "127.0.0.1:9", ttl_s=1.0)
    await registry.refresh()
    assert {e.record.replica_id for e in registry.live()} == {"r0"}
    await registry.stop()
    await index.client.flushall()
    await index.close()


async def test_a_router_whose_loop_stalled_keeps_its_live_replicas(valkey_server, monkeypatch):
    """The router's event loop stalled past the heartbeat TTL (a 2 MB body parsed under CPU
    contention did it in a soak): the request that runs first after the stall must not find
    "no live replica" while every replica heartbeats on. A real death still removes one."""
    index = RedisPrefixIndex.from_url(valkey_server.url, "stalled-router", 16, 1)
    await index.ensure_settings()
    await index.register("r0", "127.0.0.1:9", ttl_s=1.0)
    registry = ReplicaRegistry(index, refresh_s=0.1)
    await registry.refresh()
    real = time.monotonic
    monkeypatch.setattr(registry_module, "time", types.SimpleNamespace(monotonic=lambda: real() + 5.0))
    assert [e.record.replica_id for e in registry.live()] == ["r0"]  # 5 s without a read: no news
    await registry.refresh()  # r0 still heartbeats: live as read
    assert [e.record.replica_id for e in registry.live()] == ["r0"]
    monkeypatch.setattr(registry_module, "time", time)
    await asyncio.sleep(1.2)  # r0's TTL runs out in the index: a death the next read sees
    await registry.refresh()
    assert registry.live() == []
    await registry.stop()
    await index.client.flushall()
    await index.close()


async def test_registry_stops_even_if_a_refresh_swallows_its_cancellation(valkey_server, monkeypatch):
    """A cancel that lands inside a Redis call can be swallowed there; stop() must still return
    (it used to wait forever on a refresh loop that kept going: a hung server shutdown)."""
    index = RedisPrefixIndex.from_url(valkey_server.url, "swallow-test", 16, 1)
    registry = ReplicaRegistry(index, refresh_s=0.01)
    await registry.start()
    entered = asyncio.Event()

    async def swallowing_lookup():
        entered.set()
        with contextlib.suppress(asyncio.CancelledError):  # what a misbehaving client library does
            await asyncio.sleep(0.2)
        return []

    monkeypatch.setattr(index, "live_replicas", swallowing_lookup)
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(registry.stop(), 5)
    await index.close()


async def test_redis_away_for_10s_under_load(cluster):
    stop = asyncio.Event()
    outcomes = collections.Counter()
    details = set()

    async def load():
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            i = 0
            while not stop.is_set():
                result = await tracked(channel, request(1000 + i, max_tokens=8))
                outcomes[result["code"]] += 1
                details.add(result.get("details"))
                i += 1

    workers = [asyncio.create_task(load()) for _ in range(4)]
    await asyncio.sleep(1.0)
    cluster.redis.stop()
    await asyncio.sleep(10)
    degraded = not cluster.router.registry.index_ok  # load-only routing while it is away
    cluster.redis.start()
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.gather(*workers)
    assert degraded
    assert set(outcomes) == {"OK"} and outcomes["OK"] > 20, (outcomes, details)  # every request served
    assert await eventually(lambda: index_equals_every_cache(cluster), timeout=30)  # fully resynced


async def test_router_restart_under_load(cluster, qwen3_dir):
    port_router = another_router(cluster, qwen3_dir, http_port=-1)
    await port_router.start()
    port = port_router.grpc.port
    await eventually(lambda: _sees(port_router, 3))
    results = collections.Counter()
    served_then_cancelled = [0]
    restarted = asyncio.Event()

    async def client():
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}"
        ) as channel:  # one channel, kept across the restart
            for i in range(200):
                r = await tracked(channel, request(2000 + i, max_tokens=6))
                results[(r["code"], restarted.is_set())] += 1
                served_then_cancelled[0] += r["code"] == "CANCELLED" and r["chunks"] > 0
                if restarted.is_set() and r["code"] == "OK":
                    return
                await asyncio.sleep(0.02)

    clients = [asyncio.create_task(client()) for _ in range(3)]
    await asyncio.sleep(1.0)
    await port_router.stop(grace=0.2)
    await asyncio.sleep(0.5)
    again = another_router(cluster, qwen3_dir, http_port=-1, port=port)
    await again.start()
    await eventually(lambda: _sees(again, 3))
    restarted.set()
    await asyncio.wait_for(asyncio.gather(*clients), 120)
    await again.stop(grace=0.2)
    assert results[("OK", False)] > 0 and results[("OK", True)] == 3  # all reconnected on their channel
    errors = {code for code, _ in results if code != "OK"}
    assert errors <= {"UNAVAILABLE", "CANCELLED"}, results  # clean errors while it was down
    # gRPC core cancels a call it accepted in the instant its listener closed, before any
    # handler saw it: at most the one call each client had in flight then, never one served.
    cancelled = sum(n for (code, _), n in results.items() if code == "CANCELLED")
    assert cancelled <= len(clients) and served_then_cancelled[0] == 0, results


async def test_a_stream_cut_off_by_the_drain_timeout_is_unavailable(cluster, qwen3_dir):
    """A request still streaming when the router's drain time runs out ends UNAVAILABLE (retry
    elsewhere), not CANCELLED (which a client reads as its own cancellation)."""
    router = another_router(cluster, qwen3_dir, http_port=-1)
    await router.start()
    await eventually(lambda: _sees(router, 3))
    async with grpc.aio.insecure_channel(router.address) as channel:
        long = asyncio.create_task(tracked(channel, request(4000, max_tokens=3000)))
        await eventually(lambda: asyncio.sleep(0, result=router.core.active == 1))
        await asyncio.sleep(0.3)  # streaming by now
        await router.stop(grace=0.2)
        result = await long
    assert result["code"] == "UNAVAILABLE" and "drain timeout" in result["details"], result
    assert result["chunks"] > 0


async def _sees(router, n) -> bool:
    await router.registry.refresh()
    return len(router.registry.live()) == n


async def test_a_slow_replica_gets_less_work(cluster):
    slow = "replica-2"
    await eventually(lambda: asyncio.sleep(0, result=len(cluster.supervisor.actors) == 3))
    # 0.1 s a step: on a loaded 2-core CI machine (two test workers) every replica is slow,
    # and a 0.05 s delay once left this one 9 of 45 (its threshold), where alone it gets 3.
    await cluster.supervisor.actors[slow].inject_step_delay.remote(0.1)
    placed = collections.Counter()
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        limit = asyncio.Semaphore(9)

        async def one(i):
            async with limit:
                r = await tracked(channel, request(3000 + i, max_tokens=24, policy="least_loaded"))
                placed[r.get("replica")] += 1

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(45)))
    assert sum(placed.values()) == 45 and time.monotonic() - started < 120
    assert placed[slow] < 45 / 3 * 0.6, placed  # well under a fair third
