"""Routing policies as pure functions: no servers, just requests and replica states."""

import collections
import dataclasses
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
    make_policy,
)
from kvmesh.router.replica_load import ReplicaLoad, RequestWork
from kvmesh.router.speculative import SpeculativeOverlay
from kvmesh.serving.step_costs import StepCosts

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


def test_prefix_prefers_the_longest_cached_prefix():
    reps = [ReplicaState("a", matched_blocks=2), ReplicaState("b", matched_blocks=9), ReplicaState("c")]
    assert PrefixAware().rank(request(prompt(1)), reps)[0] == "b"
    assert PrefixAware().rank(request(prompt(1)), reps)[1] == "a"


# Costs chosen so the arithmetic below is easy to follow: 1 ms per prompt token, 10 ms a step.
SIMPLE = StepCosts(base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.0, context_token_s=0.0)


def test_prefix_burst_spills_exactly_when_waiting_costs_more_than_the_recompute_it_saves():
    """A burst on one prefix, nothing finishing: each request queues one uncached block on
    the holder. It stays there while waiting behind the queue costs less than computing the
    whole prompt elsewhere (its own time plus the recompute weight's share for the fleet),
    and spills at the first request for which it costs more."""
    p = PrefixAware(block_size=BS, hot_spot_factor=1e9, tie_steps=0)  # exact scores; the guard apart
    idle_elsewhere = dataclasses.replace(SIMPLE, base_s=0.011)  # 1 ms slower a step: no exact tie
    holder = ReplicaState("holder", costs=SIMPLE, step_tokens=10**9)  # queued steps cost ~nothing
    other = ReplicaState("other", costs=idle_elsewhere, step_tokens=10**9)
    shared = prompt(3, n=9 * BS)  # 9 blocks, 8 of them held
    # On the holder: queued blocks * 16 ms + one step (10 ms) + its last block (16 ms, charged
    # 1 + w times); elsewhere: one step (11 ms) + 9 blocks (144 ms, 1 + w times).
    w = p.recompute_weight
    expected_stay = next(q for q in range(1000) if q * 16 + 10 + 16 * (1 + w) > 11 + 144 * (1 + w))
    for q in range(expected_stay + 3):
        req = request(shared[:-1] + [q])
        holder.matched_blocks = 8
        holder.inflight_prefill_blocks = q
        assert p.rank(req, [holder, other])[0] == ("holder" if q < expected_stay else "other"), q
    assert expected_stay == 129  # with w = 15: a cached block is worth 16 queued ones


def test_prefix_a_replica_twice_as_slow_gets_a_third_of_the_work():
    """Two replicas, one measured twice as slow on every term, a stream of cold prompts more
    than both can serve: each drains its queue at its own speed, and the policy's predictions
    send the fast one twice the work. (Below saturation the fast one takes more than its
    share, which is what the fastest first token asks for.)"""
    fast = ReplicaState("fast", costs=SIMPLE)
    slow = ReplicaState("slow", costs=StepCosts(*(2 * c for c in dataclasses.astuple(SIMPLE))))
    p, placed, clock = PrefixAware(block_size=BS), collections.Counter(), 0.0
    for i in range(600):
        clock_step = 0.03  # a 4-block prompt every 30 ms: 64 ms of prefill on the fast one
        for r in (fast, slow):  # each computes its queue at its own speed meanwhile
            done = clock_step / (BS * r.costs.prefill_token_s)
            r.inflight_prefill_blocks = max(0.0, r.inflight_prefill_blocks - done)
        clock += clock_step
        chosen = {"fast": fast, "slow": slow}[p.rank(request(prompt(i, n=4 * BS)), [fast, slow])[0]]
        chosen.inflight_prefill_blocks += 4
        placed[chosen.replica_id] += 1
    assert placed["fast"] / sum(placed.values()) == pytest.approx(2 / 3, abs=0.04), placed


def test_prefix_priced_by_each_replicas_own_queue_and_costs():
    """The prediction is the replica's wait plus its own step and prefill, nothing else; the
    score adds the recompute weight's share of that prefill."""
    p = PrefixAware(block_size=BS)
    r = ReplicaState(
        "r",
        matched_blocks=2,
        inflight_prefill_blocks=5,
        inflight_requests=3,
        costs=StepCosts(0.01, 0.001, 0.002, 1e-5),
        step_tokens=40,
    )
    step = 0.01 + 0.002 * 3  # base, 3 sequences in flight (not the heartbeat's context)
    queued = 5 * BS
    expected = queued * 0.001 + queued / 40 * step + step + 8 * BS * 0.001  # 8 of 10 blocks uncached
    assert p.ttft(request(prompt(1)), r) == pytest.approx(expected)
    # the recompute term at the fleet's price of a prompt token, not the replica's own
    assert p.score(request(prompt(1)), r, 0.002) == pytest.approx(expected + 15 * 8 * BS * 0.002)


def test_prefix_prices_a_step_by_the_routers_counts_not_the_heartbeat():
    """Heartbeat figures are old and every router sees them alike: two replicas this router
    counts alike score alike whatever their last heartbeat said, and the one it counts less
    work on scores lower even when its heartbeat looked busier."""
    p = PrefixAware(block_size=BS)
    costs = StepCosts(0.01, 0.001, 0.002, 1e-5)
    quiet = ReplicaState("quiet", inflight_requests=2, num_running=1, num_waiting=0, costs=costs)
    busy = ReplicaState("busy", inflight_requests=2, num_running=60, num_waiting=0, costs=costs)
    assert p.score(request(prompt(1)), quiet, 0.001) == p.score(request(prompt(1)), busy, 0.001)
    busy.inflight_requests = 1
    assert p.rank(request(prompt(1)), [quiet, busy])[0] == "busy"


def test_prefix_cold_prompts_spread_but_repeat_visits_agree():
    p = PrefixAware()
    firsts = collections.Counter(p.rank(request(prompt(s)), replicas(4))[0] for s in range(200))
    assert len(firsts) == 4 and min(firsts.values()) > 25
    assert len({p.rank(request(prompt(9)), replicas(4))[0] for _ in range(10)}) == 1


def test_prefix_hot_spot_guard_with_speculative_entries():
    """30 concurrent requests, one shared prefix, nothing finishes: waiting behind one-block
    prefills stays cheaper than a cold prefill elsewhere, so only the guard spreads them."""
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
    assert max(placed.values()) <= p.cap_of(29, 3) < 30
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


def test_prefix_new_prefixes_spread_after_a_busy_minute():
    """Three replicas served a prefix and its 30 follow-ups each lately, the fourth a prefix
    alone; then 8 new prefixes arrive, one at a time. The follow-ups went where their prefix
    was, so they say nothing about where a new one should go: it spreads 2 per replica (when
    the tie-break counted every uncached block, the fourth owed the others their follow-ups
    and took 5 of the 8)."""
    p, now = PrefixAware(), 0.0
    loads = {f"r{i}": ReplicaLoad() for i in range(4)}

    def route(replica_id: str, num_blocks: int, matched: int) -> None:
        work = RequestWork.estimate(num_blocks, matched, 16, BS)
        loads[replica_id].begin(work, now)
        loads[replica_id].prefill_done(work)
        loads[replica_id].end(work)

    for replica_id in loads:
        route(replica_id, 36, 0)  # the prefix, new there
        for _ in range(30 if replica_id != "r3" else 0):
            route(replica_id, 36, 32)  # a follow-up: the prefix cached, its question not
    placed = collections.Counter()
    for seed in range(8):
        req = request(prompt(100 + seed, n=36 * BS))
        states = [ReplicaState(rid, recent_blocks=load.recent.value(now)) for rid, load in loads.items()]
        choice = p.rank(req, states)[0]
        route(choice, req.num_blocks, 0)
        placed[choice] += 1
    assert sorted(placed.values()) == [2, 2, 2, 2]


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
    ):
        ranked = make_policy(name, block_size=BS, seed=0).rank(request(prompt(3), affinity="k"), reps)
        assert sorted(ranked) == ["r0", "r1", "r2", "r3"], name


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'fastest'; known: consistent_hash"):
        make_policy("fastest")


def test_prefix_a_cheap_fit_does_not_draw_every_cold_prompt():
    """The issue-49 pile-up: one replica priced 25% cheaper (a noisy fit past the old "like
    peers" line). Its price difference now enters a cold prompt's score once, not 16 times,
    so a stream of cold prompts (each adding its prefill to the replica it went to, nothing
    finishing) spreads over all four: the cheap one takes a bit more, never the lot."""
    cheap = dataclasses.replace(SIMPLE, prefill_token_s=0.00075)
    reps = [ReplicaState("cheap", costs=cheap)] + [ReplicaState(f"r{i}", costs=SIMPLE) for i in range(3)]
    p, placed = PrefixAware(block_size=BS, hot_spot_factor=1e9), collections.Counter()
    for i in range(40):
        chosen = {r.replica_id: r for r in reps}[p.rank(request(prompt(i, n=36 * BS)), reps)[0]]
        chosen.inflight_prefill_blocks += 36
        placed[chosen.replica_id] += 1
    assert len(placed) == 4 and placed["cheap"] <= 14, placed  # fair: 10; recompute at its own price: 16


def test_prefix_a_saturated_holder_spills_its_prefix_to_a_second_holder():
    """A holder keeps its prefix until its queued prefill passes ``saturation_steps`` full
    chunks, then the next request goes to the least-loaded other replica, which is from then
    on a holder too (and keeps it while the first is saturated)."""
    p = PrefixAware(block_size=BS, hot_spot_factor=1e9, saturation_steps=2)
    shared = prompt(5, n=5 * BS)  # 4 blocks held, the last one each request's own
    holder = ReplicaState("holder", matched_blocks=4, costs=SIMPLE, step_tokens=64)
    idle = ReplicaState("idle", costs=SIMPLE, step_tokens=64)
    busy = ReplicaState("busy", costs=SIMPLE, step_tokens=64, inflight_prefill_blocks=3)
    holder.inflight_prefill_blocks = 8  # 128 queued tokens = 2 chunks: not yet over
    assert not p.saturated(holder)
    assert p.ttft(request(shared), holder) > p.ttft(request(shared), idle)  # slower, yet it stays
    assert p.rank(request(shared), [holder, idle, busy])[0] == "holder"
    assert p.branch(request(shared), [holder, idle, busy], "holder") == "prefix_hit"
    holder.inflight_prefill_blocks = 9  # over: the prefix spills to the least loaded
    assert p.rank(request(shared), [holder, idle, busy])[0] == "idle"
    assert p.branch(request(shared), [holder, idle, busy], "idle") == "spill"
    idle.matched_blocks, idle.inflight_prefill_blocks = 4, 8  # now a holder, as loaded as allowed
    assert p.rank(request(shared), [holder, idle, busy])[0] == "idle"


def test_prefix_ticks_tie_cold_scores_on_replicas_priced_apart_only():
    """Priced apart, a prompt nobody holds: replicas a step apart tie (ticks of two base steps)
    and the one with fewer new prefixes placed lately takes it; a prompt both hold, or
    replicas priced alike: the exact score."""
    costs = StepCosts(base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002, context_token_s=0.0)
    dearer = StepCosts(base_s=0.010, prefill_token_s=0.00101, decode_seq_s=0.002, context_token_s=0.0)
    p = PrefixAware(block_size=BS, hot_spot_factor=1e9)
    a = ReplicaState("a", costs=costs, inflight_requests=1)  # its step 2 ms longer
    b = ReplicaState("b", costs=dearer, recent_blocks=50)  # 1.6 ms dearer on this prompt
    cold = request(prompt(11))
    assert p.rank(cold, [a, b])[0] == "a"
    assert PrefixAware(block_size=BS, hot_spot_factor=1e9, tie_steps=0).rank(cold, [a, b])[0] == "b"
    a.matched_blocks = b.matched_blocks = 10
    assert p.rank(cold, [a, b])[0] == "b"
    a.matched_blocks = b.matched_blocks = 0
    b.costs = costs
    assert p.rank(cold, [a, b])[0] == "b"


def test_prefix_share_alarm_keeps_cold_prompts_away_but_not_a_prefix_it_holds():
    p = PrefixAware(block_size=BS)
    alarmed = ReplicaState("alarmed", share_alarm=True, costs=SIMPLE)
    other = ReplicaState("other", inflight_prefill_blocks=30, inflight_requests=2, costs=SIMPLE)
    cold = request(prompt(7))
    assert p.rank(cold, [alarmed, other])[0] == "other"  # idle, but no new prefixes there
    alarmed.matched_blocks = 9
    assert p.rank(cold, [alarmed, other])[0] == "alarmed"  # it alone holds this prompt
    alarmed.share_alarm = False
    alarmed.matched_blocks = 0
    assert p.rank(cold, [alarmed, other])[0] == "alarmed"


def test_prefix_session_key_places_a_first_turn_and_breaks_ties_only():
    """Like replicas, idle: a conversation's first turn goes where its key points, the same
    replica for every turn while loads tie, and keys spread over the fleet; but load and a
    cached prefix still decide."""
    p = PrefixAware(block_size=BS)
    firsts = {p.rank(request(prompt(s), affinity="conv-7"), replicas(4))[0] for s in range(20)}
    assert len(firsts) == 1
    spread = collections.Counter(
        p.rank(request(prompt(1), affinity=f"conv-{k}"), replicas(4))[0] for k in range(200)
    )
    assert len(spread) == 4 and min(spread.values()) > 25
    home = firsts.pop()
    reps = replicas(4)
    {r.replica_id: r for r in reps}[home].inflight_prefill_blocks = 40
    assert p.rank(request(prompt(3), affinity="conv-7"), reps)[0] != home  # load decides
    held = replicas(4)
    other = next(r for r in held if r.replica_id != home)
    other.matched_blocks = 9
    assert p.rank(request(prompt(3), affinity="conv-7"), held)[0] == other.replica_id  # the cache decides


def test_prefix_prices_a_host_hit_by_the_restore_time_its_replica_measured():
    """Blocks only a host tier holds cost their restore, not their recompute: on a fast link a
    host holder is nearly as good as a device holder; on a link slower than recomputing, worse
    than recomputing on an idle replica."""
    p = PrefixAware(block_size=BS, tie_steps=0)
    req = request(prompt(4, n=9 * BS))  # 9 blocks: 16 ms each to recompute at SIMPLE's prices
    device = ReplicaState("device", costs=SIMPLE, matched_blocks=8)
    host = ReplicaState("host", costs=SIMPLE, matched_blocks=2, tiered_blocks=8, restore_block_s=0.001)
    cold = ReplicaState("cold", costs=dataclasses.replace(SIMPLE, base_s=0.009))
    assert p.ttft(req, host) == pytest.approx(p.ttft(req, device) + 6 * 0.001)  # 6 blocks restored
    assert p.rank(req, [host, cold]) == ["host", "cold"]
    assert p.rank(req, [device, host, cold])[0] == "device"
    assert p.branch(req, [host, cold], "host") == "prefix_hit"  # a host hit is a hit
    slow = dataclasses.replace(host, restore_block_s=1.0)  # a second a block: recompute wins
    assert p.rank(req, [slow, cold])[0] == "cold"
    assert p.uncached_tokens(req, host) == BS and p.restore_seconds(req, device) == 0
    # equal load: device hit, then host hit, then recompute
    whole = dataclasses.replace(host, matched_blocks=0)
    assert p.rank(req, [cold, whole, device]) == ["device", "host", "cold"]
    # a device holder with a deep queue loses to an idle host holder whose restores are cheap...
    busy = dataclasses.replace(device, inflight_prefill_blocks=40, inflight_requests=4)
    assert p.rank(req, [busy, whole])[0] == "host"
    # ...and keeps the request where that replica's measured restores cost more than the queue
    assert p.rank(req, [busy, dataclasses.replace(whole, restore_block_s=0.2)])[0] == "device"
