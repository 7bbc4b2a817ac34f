"""The share alarm (issue 49): a replica that took far more than its fair share of one model's
new prefixes (or their prefill) lately turns it on, once; it clears below its line, forgets
replicas that left and judges only the window. End to end, new prefixes forced on one replica
of a real router are logged once, counted, shown by the gauge and ``kvmesh status``, and the
prefix policy sends that replica no cold prompt meanwhile."""

import asyncio
import logging
import random

import grpc
import pytest
import pytest_asyncio
from helpers import eventually, local_router_config

from kvmesh.cli import status
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.engine.config import EngineConfig
from kvmesh.protos import pb, pb_grpc
from kvmesh.replica.config import ReplicaConfig
from kvmesh.replica.process import ReplicaServer
from kvmesh.router.config import BalanceConfig
from kvmesh.router.metrics import ReplicaGauges, RouterMetrics
from kvmesh.router.policies import ConsistentHash, ReplicaState, RouteRequest
from kvmesh.router.process import RouterServer
from kvmesh.router.replica_load import RequestWork
from kvmesh.router.share_alarm import CLEAR_AT, Change, ShareAlarm
from kvmesh.serving.metrics import read_samples

FOUR = ("a", "b", "c", "d")  # fair share 1/4, line 1/2 at factor 2


def sent(
    alarm: ShareAlarm, counts: dict[str, int], now: float = 0.0, prefill: float = 1.0, new: bool = True
) -> None:
    """Record ``counts[rid]`` requests to each replica, each with ``prefill`` uncached blocks,
    new prefixes there unless ``new`` is false."""
    for rid, n in counts.items():
        for _ in range(n):
            alarm.record(rid, RequestWork(prefill, 1.0, new), now)


# ---------------------------------------------------------------------- ShareAlarm alone


def test_a_replica_over_its_line_turns_the_alarm_on_once():
    alarm = ShareAlarm(factor=2.0, min_per_replica=2)
    sent(alarm, {"a": 12, "b": 2, "c": 2, "d": 2})
    (change,) = alarm.update(FOUR, 1.0)
    assert change == Change("a", True, 12 / 18, 12 / 18, 0.25)
    assert alarm.on == {"a"}
    assert alarm.update(FOUR, 1.5) == []  # still on: no second change


def test_nothing_is_judged_below_the_minimum_of_requests():
    alarm = ShareAlarm(factor=2.0, min_per_replica=5)
    sent(alarm, {"a": 16, "b": 1, "c": 1, "d": 1})
    assert alarm.update(FOUR, 1.0) == [] and not alarm.on


def test_a_lone_replica_never_alarms():
    alarm = ShareAlarm(min_per_replica=2)
    sent(alarm, {"a": 10})
    assert alarm.update(["a"], 1.0) == [] and not alarm.on


def test_two_replicas_can_alarm_halfway_between_fair_and_all():
    """Twice a fair half is everything, which no share exceeds: the line is capped at 3/4."""
    alarm = ShareAlarm(factor=2.0, min_per_replica=2)
    assert alarm.line(2) == 0.75
    sent(alarm, {"a": 7, "b": 3})  # 0.7: under the line
    assert alarm.update(["a", "b"], 1.0) == []
    sent(alarm, {"a": 6})  # 13 of 16
    assert [c.replica_id for c in alarm.update(["a", "b"], 1.0) if c.on] == ["a"]


def test_it_clears_only_under_clear_at_of_its_line():
    alarm = ShareAlarm(factor=2.0, min_per_replica=2)
    sent(alarm, {"a": 12, "b": 2, "c": 2, "d": 2})
    alarm.update(FOUR, 1.0)
    sent(alarm, {"b": 2, "c": 2, "d": 2})  # 12 of 24: at the line, above CLEAR_AT of it
    assert CLEAR_AT * alarm.line(4) <= 12 / 24
    assert alarm.update(FOUR, 1.0) == [] and alarm.on == {"a"}
    sent(alarm, {"b": 4, "c": 4, "d": 4})  # 12 of 36: under CLEAR_AT of the line
    (change,) = alarm.update(FOUR, 1.0)
    assert (change.replica_id, change.on) == ("a", False) and not alarm.on


def test_a_replica_that_left_is_forgotten():
    alarm = ShareAlarm(factor=2.0, min_per_replica=2)
    sent(alarm, {"a": 12, "b": 2, "c": 2, "d": 2})
    alarm.update(FOUR, 1.0)
    changes = alarm.update(["b", "c", "d"], 1.5)
    assert Change("a", False, 0.0, 0.0, 1 / 3) in changes and "a" not in alarm.on


def test_the_window_slides_old_requests_out():
    alarm = ShareAlarm(factor=2.0, window_s=10.0, min_per_replica=2, buckets=5)
    sent(alarm, {"a": 30}, now=0.0)  # a pile-up long ago
    sent(alarm, {rid: 3 for rid in FOUR}, now=12.5)  # an even spread lately
    assert alarm.update(FOUR, 13.0) == [] and not alarm.on  # the pile's bucket has left
    sent(alarm, {"a": 20}, now=13.0)
    alarm.update(FOUR, 13.0)
    assert alarm.on == {"a"}
    assert [c.on for c in alarm.update(FOUR, 30.0)] == [False]  # nothing left in the window


def test_a_share_of_prefill_alone_turns_it_on():
    alarm = ShareAlarm(factor=2.0, min_per_replica=2)
    sent(alarm, {"a": 5}, prefill=40.0)
    sent(alarm, {"b": 5, "c": 5, "d": 5}, prefill=1.0)
    (change,) = alarm.update(FOUR, 1.0)
    assert change.on and change.request_share == 0.25 and change.prefill_share == 200 / 215


def test_requests_that_found_their_prefix_are_not_counted():
    """60 requests of a hot prefix on its holder (each with a question of its own to compute)
    and 60 copies of one cached prompt (a latency probe): neither places a new prefix."""
    alarm = ShareAlarm(factor=2.0, min_per_replica=2)
    sent(alarm, {"a": 60}, prefill=2.0, new=False)
    sent(alarm, {"b": 60}, prefill=0.0)
    sent(alarm, {rid: 3 for rid in FOUR})
    assert alarm.update(FOUR, 1.0) == [] and not alarm.on


def test_the_metrics_count_alarms_turned_on_and_show_the_gauge():
    metrics = RouterMetrics("m")
    rows = [ReplicaGauges("a", 0, 0, 0, 0, 0, 0, share_alarm=True), ReplicaGauges("b", 0, 0, 0, 0, 0, 0)]
    metrics.watch_replicas(lambda: rows, lambda: True)
    metrics.count_share_alarm(Change("a", True, 0.9, 0.9, 0.5))
    metrics.count_share_alarm(Change("a", False, 0.1, 0.1, 0.5))
    samples = read_samples(metrics.render().decode())
    assert samples[("kvmesh_router_share_alarms_total", ())] == 1
    gauge = "kvmesh_router_replica_share_alarm"
    assert samples[(gauge, (("replica", "a"),))] == 1 and samples[(gauge, (("replica", "b"),))] == 0


# ---------------------------------------------------------------------- a real router

BS = 16
PILE = 12  # requests forced on one replica: over the minimum below
ALARM = BalanceConfig(share_alarm_min_per_replica=5, share_alarm_window_s=30.0)
WARNED = "replica took far over its fair share"


def replica_config(model_dir, redis_url: str, replica_id: str) -> ReplicaConfig:
    engine = EngineConfig(num_kv_blocks=128, block_size=BS, max_model_len=256)
    return ReplicaConfig(str(model_dir), replica_id, redis_url, http_port=-1, engine=engine)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(qwen3_dir):
    redis = EmbeddedRedis().start()
    replicas = [ReplicaServer(replica_config(qwen3_dir, redis.url, f"share-{i}")) for i in range(2)]
    for replica in replicas:
        await replica.start()
    router = RouterServer(local_router_config(qwen3_dir, redis.url, http_port=-1, balance=ALARM))
    await router.start()
    assert await eventually(lambda: asyncio.sleep(0, result=len(router.registry.live()) == 2))
    channel = grpc.aio.insecure_channel(router.address)
    yield {"router": router, "stub": pb_grpc.RouterStub(channel)}
    await channel.close()
    await router.stop(grace=0.5)
    for replica in replicas:
        await replica.stop(grace=0.5)
    redis.close()


def random_prompt(seed: int) -> list[int]:
    """3 blocks of token ids of the tiny model's vocabulary, its own for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(3 * BS)]


async def send(stub, ids: list[int], policy: str = "") -> str:
    """One request; the replica that answered it."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=1), policy=policy
    )
    async for response in stub.Generate(request, timeout=60):
        if response.WhichOneof("kind") == "complete":
            return response.complete.replica_id
    raise AssertionError("no Complete")


@pytest.mark.servers
@pytest.mark.asyncio(loop_scope="module")
async def test_a_forced_pile_up_fires_the_alarm_once_end_to_end(fleet, caplog):
    """Every request names ``consistent_hash`` with a 3-block prompt of its own, picked so that
    the policy's hash puts all on one replica: new prefixes, all there."""
    router, stub = fleet["router"], fleet["stub"]
    states = [ReplicaState(e.record.replica_id) for e in router.registry.live()]
    hashed = ConsistentHash(block_size=BS)

    def first_choice(ids: list[int]) -> str:
        return hashed.rank(RouteRequest(ids, (), 1), states)[0]

    candidates = [random_prompt(seed) for seed in range(4 * PILE)]
    target = first_choice(candidates[0])
    prompts = [ids for ids in candidates if first_choice(ids) == target][:PILE]
    assert len(prompts) == PILE
    with caplog.at_level(logging.INFO, logger="kvmesh.router.registry"):
        (piled,) = set(await asyncio.gather(*(send(stub, p, "consistent_hash") for p in prompts)))
        assert await eventually(lambda: asyncio.sleep(0, result=piled in router.registry.alarm.on))
        await asyncio.sleep(3 * router.registry.refresh_s)  # a few more judgements: still one line
    warned = [r for r in caplog.records if WARNED in r.getMessage()]
    assert [(r.levelno, r.replica_id) for r in warned] == [(logging.WARNING, piled)]

    samples = read_samples(router.core.render_metrics().decode())
    assert samples[("kvmesh_router_share_alarms_total", ())] == 1
    gauge = {
        dict(ls)["replica"]: v for (n, ls), v in samples.items() if n == "kvmesh_router_replica_share_alarm"
    }
    assert len(gauge) == 2 and {rid for rid, v in gauge.items() if v == 1} == {piled}

    listing = await stub.ListReplicas(pb.ListReplicasRequest())
    assert len(listing.replicas) == 2 and [r.replica_id for r in listing.replicas if r.share_alarm] == [piled]
    (line,) = [
        line
        for line in status.render(await status.from_router(router.address, None)).splitlines()
        if status.SHARE_ALARM in line
    ]
    assert line.split()[0] == piled

    cold = random_prompt(10**6)  # a prompt nobody holds: not to the piled replica
    assert await send(stub, cold) != piled
