"""A router that knows when its index lies: each fault is detected within 10 s with the
right cause, and recovered from; steady load raises no alarm.

One router and two replicas run in this process (real gRPC, a real valkey, the real engine
on the tiny model), so faults can be injected inside a replica: a different hash seed,
KV events dropped, a cache reset that sends no event, Redis flushed, a replica restarted.
Requests go to a chosen replica through the ``consistent_hash`` policy (a prompt whose first
blocks rendezvous-hash to it); the router predicts and checks every request whatever the
policy.
"""

import asyncio
import random
import time

import grpc
import observability
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import eventually, local_router_config, metric
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cli import status
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.kvcache import block_hashes
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.index_trust.predictions import LIES
from kvmesh.router.index_trust.states import DEGRADED, EXACT, LOAD_ONLY, IndexTrustConfig
from kvmesh.router.policies import ReplicaState, RouteRequest, make_policy
from kvmesh.router.process import RouterServer
from kvmesh.serving.metrics import read_samples

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.servers]

BS = 16
DETECT_S = 10.0
HEALTH = IndexTrustConfig(window=20, max_age_s=4.0, min_samples=4, lag_tolerance_s=1.0, resync_interval_s=2.0)
SETTLE_S = 1.3  # longer than the lag tolerance and the speculative entries' life (0.5 s)
rng = random.Random(7)


def replica_config(model_dir, redis_url: str, replica_id: str) -> ReplicaConfig:
    engine = EngineConfig(num_kv_blocks=256, block_size=BS, max_model_len=512)
    return ReplicaConfig(str(model_dir), replica_id, redis_url, http_port=-1, engine=engine)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(qwen3_dir):
    redis = EmbeddedRedis().start()
    replicas = {}
    for rid in ("trust-0", "trust-1"):
        replicas[rid] = ReplicaServer(replica_config(qwen3_dir, redis.url, rid))
        await replicas[rid].start()
    router = RouterServer(
        local_router_config(qwen3_dir, redis.url, http_port=-1, speculative_ttl_s=0.5, index_trust=HEALTH)
    )
    await router.start()
    assert await eventually(lambda: asyncio.sleep(0, result=len(router.registry.live()) == 2))
    channel = grpc.aio.insecure_channel(router.address)
    yield {
        "router": router,
        "replicas": replicas,
        "redis": redis,
        "stub": pb_grpc.RouterStub(channel),
        "dir": qwen3_dir,
    }
    await channel.close()
    await router.stop(grace=0.5)
    for replica in replicas.values():
        await replica.stop(grace=0.5)
    redis.close()


STEER = make_policy("consistent_hash", block_size=BS)


def routed_to(fleet: dict, ids: list[int]) -> str:
    """Where ``consistent_hash`` sends ``ids`` among this fleet's replicas."""
    assert len(ids) >= STEER.prefix_blocks * BS, "a shorter prompt is keyed by all its tokens"
    model = fleet["router"].core.model
    request = RouteRequest(ids, block_hashes(ids, model.block_size, model.hash_seed))
    return STEER.rank(request, [ReplicaState(rid) for rid in fleet["replicas"]])[0]


def prompt(blocks: int, fleet: dict | None = None, replica_id: str | None = None) -> list[int]:
    """Random token ids; with ``replica_id``, ones that ``send`` routes there, and so does
    every prompt that starts with them (``consistent_hash`` keys a prompt of
    ``STEER.prefix_blocks`` blocks or more by its first ones, hashed as the router does)."""
    while True:
        ids = [rng.randrange(10, 1000) for _ in range(blocks * BS)]
        if replica_id is None or routed_to(fleet, ids) == replica_id:
            return ids


async def send(fleet, ids: list[int], replica_id: str | None = None) -> pb.Complete:
    """One request (to ``replica_id`` if given: a prompt from ``prompt(..., replica_id)``); its
    Complete."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=1))
    if replica_id:
        req.policy = "consistent_hash"
    async for r in fleet["stub"].Generate(req, timeout=60):
        if r.WhichOneof("kind") == "complete":
            assert not replica_id or r.complete.replica_id == replica_id
            return r.complete
    raise AssertionError("no Complete")


def state(fleet, replica_id: str) -> tuple[str, str]:
    return fleet["router"].core.watch.state(replica_id)


def metric_labels(fleet, name: str, label: str = "replica") -> set[str]:
    samples = read_samples(fleet["router"].core.render_metrics().decode())
    return {dict(ls)[label] for (n, ls), _ in samples.items() if n == name}


async def until_state(fleet, replica_id: str, wanted: str, feed=None, timeout: float = DETECT_S) -> float:
    """Seconds until the replica's state is ``wanted`` (sending ``feed()`` meanwhile, if given)."""
    start = time.monotonic()
    while state(fleet, replica_id)[0] != wanted:
        assert time.monotonic() - start < timeout, (
            f"{replica_id} still {state(fleet, replica_id)} after {timeout} s"
        )
        if feed is not None:
            await feed()
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def alarms(fleet, replica_id: str, cause: str) -> float:
    """Times the router stopped trusting the replica's entries (DEGRADED or LOAD_ONLY) for ``cause``."""
    return sum(
        metric(
            fleet["router"].core,
            "kvmesh_router_replica_index_state_changes_total",
            replica=replica_id,
            state=s,
            cause=cause,
        )
        for s in (DEGRADED, LOAD_ONLY)
    )


async def until_alarm(fleet, replica_id: str, cause: str, before: float, timeout: float) -> None:
    start = time.monotonic()
    while alarms(fleet, replica_id, cause) <= before:
        assert time.monotonic() - start < timeout, f"no {cause} alarm for {replica_id} in time"
        await asyncio.sleep(0.02)


async def exact_again(fleet, replica_id: str) -> None:
    """Recovered: the state is EXACT and a repeated prefix is predicted exactly."""
    await until_state(fleet, replica_id, EXACT)
    ids = prompt(4, fleet, replica_id)
    await send(fleet, ids + [5], replica_id)
    await asyncio.sleep(SETTLE_S)  # past speculation: the index alone must know it
    c = await send(fleet, ids + [6, 7], replica_id)
    assert c.predicted_cached_tokens == c.usage.cached_tokens == 4 * BS


async def test_steady_load_raises_no_alarm(fleet):
    """10 s of shared-prefix traffic from 4 clients through the prefix policy: no lie, no
    resync, every state EXACT all along (longer runs are `kvmesh bench soak`'s)."""
    groups = [prompt(5) for _ in range(8)]
    seen: set[str] = set()
    stop = time.monotonic() + 10

    async def client(k: int) -> int:
        n = 0
        while time.monotonic() < stop:
            await send(fleet, rng.choice(groups) + prompt(1)[: rng.randrange(2, 30)])
            n += 1
        return n

    async def watch() -> None:
        while time.monotonic() < stop:
            seen.update(state(fleet, rid)[0] for rid in fleet["replicas"])
            seen.add(fleet["router"].core.watch.overall()[0])
            await asyncio.sleep(0.05)

    counts, _ = await asyncio.gather(asyncio.gather(*(client(k) for k in range(4))), watch())
    assert sum(counts) > 30, counts
    assert seen == {EXACT}
    assert (
        sum(metric(fleet["router"].core, "kvmesh_router_prediction_misses_total", cause=c) for c in LIES) == 0
    )
    assert metric(fleet["router"].core, "kvmesh_router_index_resyncs_total") == 0
    checked = metric(fleet["router"].core, "kvmesh_router_prediction_error_blocks_count")
    exact = metric(fleet["router"].core, "kvmesh_router_prediction_error_blocks_bucket", le="0.5") - metric(
        fleet["router"].core, "kvmesh_router_prediction_error_blocks_bucket", le="-0.5"
    )
    # a lookup that timed out on a starved machine routes by load only, and checks nothing
    fell_back = metric(fleet["router"].core, "kvmesh_router_index_errors_total")
    assert checked + fell_back >= sum(counts) and fell_back <= sum(counts) * 0.05
    assert exact / checked > 0.9


async def test_a_replica_hashing_with_another_seed_is_routed_by_load_only(fleet):
    rid = "trust-0"
    engine = fleet["replicas"][rid].engine
    seed = await engine.call(lambda e: e.block_manager.seed)
    await engine.call(lambda e: setattr(e.block_manager, "seed", seed ^ 0x5EED))
    try:
        took = await until_state(fleet, rid, LOAD_ONLY, feed=lambda: send(fleet, prompt(4, fleet, rid), rid))
        assert took < DETECT_S and state(fleet, rid) == (LOAD_ONLY, "hash_mismatch")
        assert rid in fleet["router"].core.watch.untrusted()
        listing = await fleet["stub"].ListReplicas(pb.ListReplicasRequest())
        (info,) = [r for r in listing.replicas if r.replica_id == rid]
        assert (info.index_state, info.index_state_cause) == ("LOAD_ONLY", "hash_mismatch")
        assert listing.index_state == "DEGRADED"  # the other replica is still EXACT
        assert (
            metric(
                fleet["router"].core,
                "kvmesh_router_prediction_misses_total",
                replica=rid,
                cause="hash_mismatch",
            )
            > 0
        )
        assert (
            metric(fleet["router"].core, "kvmesh_router_replica_index_state", replica=rid, state="LOAD_ONLY")
            == 1
        )
    finally:
        await engine.call(lambda e: setattr(e.block_manager, "seed", seed))
    await until_state(fleet, rid, EXACT, feed=lambda: send(fleet, prompt(4, fleet, rid), rid))
    await exact_again(fleet, rid)


async def test_dropped_kv_events_are_found_stale_and_resynced(fleet, monkeypatch):
    rid = "trust-0"
    publisher = fleet["replicas"][rid].publisher

    async def drop() -> None:  # the fault: events lost between the replica and Redis
        publisher._buffer.clear()

    monkeypatch.setattr(publisher, "_publish_buffer", drop)
    resyncs = metric(fleet["router"].core, "kvmesh_router_index_resyncs_total", replica=rid)
    before = alarms(fleet, rid, "stale_index")
    prefixes = [prompt(4, fleet, rid) for _ in range(5)]
    for p in prefixes:
        await send(fleet, p + [1], rid)
    await asyncio.sleep(SETTLE_S)
    start = time.monotonic()
    answers = [await send(fleet, p + [2, 3], rid) for p in prefixes]  # a resync may come in between
    assert (answers[0].predicted_cached_tokens, answers[0].usage.cached_tokens) == (0, 4 * BS)
    await until_alarm(fleet, rid, "stale_index", before, DETECT_S - (time.monotonic() - start))
    assert (
        metric(
            fleet["router"].core, "kvmesh_router_prediction_misses_total", replica=rid, cause="stale_index"
        )
        >= 1
    )
    monkeypatch.undo()
    # LOAD_ONLY asks the replica to resync; its new incarnation starts a fresh window
    assert await eventually(
        lambda: asyncio.sleep(
            0, result=metric(fleet["router"].core, "kvmesh_router_index_resyncs_total", replica=rid) > resyncs
        )
    )
    await exact_again(fleet, rid)


async def test_a_cache_reset_without_events_is_found_stale(fleet):
    rid = "trust-1"
    before = alarms(fleet, rid, "stale_index")
    prefixes = [prompt(4, fleet, rid) for _ in range(5)]
    for p in prefixes:
        await send(fleet, p + [1], rid)
    await asyncio.sleep(SETTLE_S)

    def silent_reset(engine) -> None:
        engine.block_manager.enable_events = False
        try:
            engine.block_manager.reset()
        finally:
            engine.block_manager.enable_events = True

    await fleet["replicas"][rid].engine.call(silent_reset)
    start = time.monotonic()
    answers = [await send(fleet, p + [2, 3], rid) for p in prefixes]  # a resync may come in between
    assert (answers[0].predicted_cached_tokens, answers[0].usage.cached_tokens) == (4 * BS, 0)
    await until_alarm(fleet, rid, "stale_index", before, DETECT_S - (time.monotonic() - start))
    await exact_again(fleet, rid)


async def test_a_flushed_redis_is_reported_and_recovered(fleet):
    router = fleet["router"]
    seen = []

    async def record(live: int) -> None:
        seen.append((router.registry.index_problem, router.core.watch.overall()))

    router.registry.on_change(record)
    client = aioredis.from_url(fleet["redis"].url)
    start = time.monotonic()
    await client.flushall()
    await client.aclose()
    # Read the index now, before a replica's next publish or heartbeat re-registers it: a
    # replica that resyncs first leaves no "lost data" for the router to see (a flake, once).
    await router.registry.refresh()
    assert await eventually(
        lambda: asyncio.sleep(0, result=("index lost its data", (LOAD_ONLY, "index lost its data")) in seen),
        DETECT_S,
    )
    assert time.monotonic() - start < DETECT_S
    assert await eventually(
        lambda: asyncio.sleep(
            0, result=router.registry.index_problem == "" and len(router.registry.live()) == 2
        ),
        15,
    )
    assert router.core.watch.overall()[0] == EXACT
    for rid in fleet["replicas"]:
        await exact_again(fleet, rid)


async def test_a_restarted_replica_is_seen_and_starts_afresh(fleet):
    rid = "trust-1"
    before = metric(fleet["router"].core, "kvmesh_router_replica_restarts_total", replica=rid)
    await fleet["replicas"][rid].stop(grace=0.5)
    gauge = "kvmesh_router_replica_running_requests"
    assert await eventually(
        lambda: asyncio.sleep(0, result=metric_labels(fleet, gauge) == {"trust-0"})
    )  # gone
    fleet["replicas"][rid] = ReplicaServer(replica_config(fleet["dir"], fleet["redis"].url, rid))
    await fleet["replicas"][rid].start()
    start = time.monotonic()
    assert await eventually(
        lambda: asyncio.sleep(
            0,
            result=metric(fleet["router"].core, "kvmesh_router_replica_restarts_total", replica=rid)
            == before + 1,
        ),
        DETECT_S,
    )
    assert time.monotonic() - start < DETECT_S
    assert state(fleet, rid) == (EXACT, "")
    await exact_again(fleet, rid)


async def test_every_metric_the_dashboard_and_alerts_name_is_exported(fleet):
    """Scrape the live router and replicas: each name a dashboard query or an alert uses exists."""
    await send(fleet, prompt(3) + [1])
    exported = set()
    pages = [fleet["router"].core.render_metrics()] + [
        r.backend.render_metrics() for r in fleet["replicas"].values()
    ]
    for page in pages:  # a family counts before its first sample (labelled ones have none yet)
        for family in text_string_to_metric_families(page.decode()):
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(
                family.type, ("",)
            )
            exported |= {family.name + suffix for suffix in suffixes}
    named = observability.metric_names()
    assert len(named) >= 15
    missing = sorted(named - exported)
    assert not missing, f"named by the dashboard or alerts, exported by nobody: {missing}"


async def test_kvmesh_status_shows_the_index_states(fleet):
    models = await status.from_router(fleet["router"].address, None)
    (model,) = models
    assert model["index_state"] == "EXACT"
    assert {r["index_state"] for r in model["replicas"]} == {"EXACT"}
    table = status.render(models)
    assert "index EXACT" in table and table.count("index EXACT") == 1 + len(model["replicas"])
