"""Routing policies as pure functions: no servers, just requests and replica states."""

import collections
import random

import pytest

from kvmesh.kvcache import block_hashes
from kvmesh.router.policies import (
    ConsistentHash,
    LeastLoaded,
    PowerOfTwo,
    PrefixAware,
    RandomChoice,
    ReplicaState,
    RoundRobin,
    RouteRequest,
    Session,
    make_policy,
)
from kvmesh.router.speculative import SpeculativeOverlay

BS = 16


def request(tokens, max_tokens=16, affinity=""):
    return RouteRequest(tokens, block_hashes(tokens, BS, 0), max_tokens, affinity)


def replicas(n=3, **kw):
    return [ReplicaState(f"r{i}", **kw) for i in range(n)]


def prompt(seed, n=160):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_round_robin_cycles_in_id_order():
    p = RoundRobin()
    firsts = [p.rank(request([1]), replicas())[0] for _ in range(6)]
    assert firsts == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_least_loaded_prefers_fewest_in_flight_then_queue():
    reps = [
        ReplicaState("a", inflight_requests=3),
        ReplicaState("b", inflight_requests=1, num_waiting=1),
        ReplicaState("c", inflight_requests=1),
    ]
    assert LeastLoaded().rank(request([1]), reps) == ["c", "b", "a"]


def test_power_of_two_never_picks_the_busiest_first():
    p = PowerOfTwo(seed=1)
    reps = [ReplicaState(f"r{i}", inflight_requests=i) for i in range(4)]
    firsts = collections.Counter(p.rank(request([1]), reps)[0] for _ in range(400))
    assert "r3" not in firsts and firsts["r0"] > firsts["r2"]
    assert sorted(p.rank(request([1]), reps)) == ["r0", "r1", "r2", "r3"]


def test_random_uses_everyone():
    p = RandomChoice(seed=3)
    firsts = collections.Counter(p.rank(request([1]), replicas(4))[0] for _ in range(400))
    assert set(firsts) == {"r0", "r1", "r2", "r3"} and min(firsts.values()) > 60


def test_consistent_hash_keys_on_the_first_blocks():
    p = ConsistentHash(prefix_blocks=4, block_size=BS)
    base = prompt(1)
    same_head = base[: 4 * BS] + prompt(2)[4 * BS :]
    assert p.rank(request(base), replicas())[0] == p.rank(request(same_head), replicas())[0]
    chosen = p.rank(request(base), replicas(5))[0]
    survivors = [r for r in replicas(5) if r.replica_id not in {chosen} and r.replica_id != "r4"] + [
        ReplicaState(chosen)
    ]
    assert p.rank(request(base), survivors)[0] == chosen  # removing another replica moves nothing
    spread = collections.Counter(p.rank(request(prompt(s)), replicas(4))[0] for s in range(200))
    assert len(spread) == 4 and min(spread.values()) > 25
    short = [5, 6, 7]  # under one block: keyed on tokens
    assert p.rank(request(short), replicas())[0] == p.rank(request(short), replicas())[0]


def test_session_affinity():
    p = Session()
    assert len({p.rank(request(prompt(s), affinity="user-7"), replicas())[0] for s in range(20)}) == 1
    assert len({p.rank(request([1], affinity=f"user-{k}"), replicas())[0] for k in range(50)}) == 3
    busy = [ReplicaState("r0", inflight_requests=5), ReplicaState("r1")]
    assert p.rank(request([1]), busy)[0] == "r1"  # no key: least loaded


def test_prefix_prefers_the_longest_cached_prefix():
    reps = [ReplicaState("a", matched_blocks=2), ReplicaState("b", matched_blocks=9), ReplicaState("c")]
    assert PrefixAware().rank(request(prompt(1)), reps)[0] == "b"
    assert PrefixAware().rank(request(prompt(1)), reps)[1] == "a"


def test_prefix_weighs_load_against_cache():
    req = request(prompt(1))  # 10 blocks
    reps = [ReplicaState("hot", matched_blocks=10, inflight_prefill_blocks=200), ReplicaState("idle")]
    assert PrefixAware().rank(req, reps)[0] == "idle"  # recomputing 10 blocks beats 200 queued
    reps[0].inflight_prefill_blocks = 100
    assert PrefixAware().rank(req, reps)[0] == "hot"  # but not 100: a cached block is worth 16 queued
    reps[0].inflight_prefill_blocks, reps[0].inflight_decode_blocks = 0, 800
    assert PrefixAware().rank(req, reps)[0] == "idle"  # decode load counts too, at a lower weight


def test_prefix_cold_prompts_spread_but_repeat_visits_agree():
    p = PrefixAware()
    firsts = collections.Counter(p.rank(request(prompt(s)), replicas(4))[0] for s in range(200))
    assert len(firsts) == 4 and min(firsts.values()) > 25
    assert len({p.rank(request(prompt(9)), replicas(4))[0] for _ in range(10)}) == 1


def test_prefix_hot_spot_guard_with_speculative_entries():
    """30 concurrent requests, one shared prefix, nothing finishes: at most half on one replica."""
    p, overlay = PrefixAware(), SpeculativeOverlay(ttl_s=60)
    shared = prompt(1, n=512)
    reps = {r.replica_id: r for r in replicas(3)}
    placed = collections.Counter()
    for i in range(30):
        req = request(shared + [i, i + 1, i + 2])
        spec = overlay.matched(req.block_hashes, now=0)
        for r in reps.values():
            r.matched_blocks = spec.get(r.replica_id, 0)
        choice = p.rank(req, list(reps.values()))[0]
        overlay.record(choice, req.block_hashes, now=0)
        reps[choice].inflight_requests += 1
        reps[choice].inflight_prefill_blocks += req.num_blocks - reps[choice].matched_blocks
        reps[choice].inflight_decode_blocks += 1
        placed[choice] += 1
    assert max(placed.values()) <= 15
    assert placed.most_common(1)[0][1] >= 8  # still mostly where the prefix is


def test_prefix_sequential_shared_prefix_stays_on_one_replica():
    p, overlay = PrefixAware(), SpeculativeOverlay(ttl_s=60)
    shared = prompt(2, n=300)
    reps = replicas(3)
    chosen = set()
    for i in range(10):  # one at a time: nothing in flight when the next arrives
        req = request(shared + [i])
        spec = overlay.matched(req.block_hashes, now=0)
        for r in reps:
            r.matched_blocks = spec.get(r.replica_id, 0)
        choice = p.rank(req, reps)[0]
        overlay.record(choice, req.block_hashes, now=0)
        chosen.add(choice)
    assert len(chosen) == 1


def test_speculative_overlay_expires_and_is_bounded():
    o = SpeculativeOverlay(ttl_s=1.0, max_entries=5)
    o.record("a", [1, 2, 3], now=0)
    o.record("b", [1, 2], now=0.2)
    assert o.matched([1, 2, 3, 4], now=0.5) == {"a": 3, "b": 2}
    assert o.matched([2, 3], now=0.5) == {"a": 2, "b": 1}
    assert o.matched([1, 2, 3], now=1.1) == {"b": 2}  # a's entries expired first
    assert o.matched([1, 2, 3], now=1.5) == {} and len(o) == 0
    o.record("a", range(10), now=2)
    assert len(o) == 5 and o.matched([0], now=2) == {} and o.matched([5, 6], now=2) == {"a": 2}


def test_every_policy_ranks_every_replica_once():
    reps = replicas(4)
    for name in (
        "prefix",
        "round_robin",
        "least_loaded",
        "power_of_two",
        "random",
        "consistent_hash",
        "session",
    ):
        ranked = make_policy(name, block_size=BS, seed=0).rank(request(prompt(3), affinity="k"), reps)
        assert sorted(ranked) == ["r0", "r1", "r2", "r3"], name


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'fastest'; known: consistent_hash"):
        make_policy("fastest")
