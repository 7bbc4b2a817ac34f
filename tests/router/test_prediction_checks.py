"""Prediction checks and index trust without servers: each miss put down to its cause, the per-replica trust
state's transitions, and the policy's branch labels."""

import pytest

from kvmesh.protos import pb
from kvmesh.router.decision import Decision
from kvmesh.router.index_trust.predictions import Prediction, miss_cause
from kvmesh.router.index_trust.states import (
    DEGRADED,
    EXACT,
    LOAD_ONLY,
    IndexTrustConfig,
    ReplicaTrust,
    overall_state,
)
from kvmesh.router.policies import PrefixAware, ReplicaState, RouteRequest

BS = 16


def complete(cached_blocks: int, **fields) -> pb.Complete:
    return pb.Complete(
        usage=pb.Usage(cached_tokens=cached_blocks * BS, prompt_tokens=200), incarnation=7, **fields
    )


def predicted(index: int, speculative: int = 0, incarnation: int = 7) -> Prediction:
    return Prediction("r0", incarnation, max(index, speculative), index, speculative, max(index, speculative))


@pytest.mark.parametrize(
    "prediction, answer, cause",
    [
        (predicted(4), complete(4), None),
        (predicted(4, incarnation=6), complete(4), "replica_restarted"),
        (predicted(0), complete(3, hash_mismatch=True), "hash_mismatch"),
        (predicted(2, speculative=5), complete(2), "speculative_unrealized"),
        (predicted(5), complete(2, miss_evicted_age_ms=300), "evicted"),
        (predicted(5), complete(2, miss_evicted_age_ms=9000), "stale_index"),  # its Removed event got lost
        (predicted(5), complete(2), "stale_index"),  # never evicted: the index claimed what was not there
        (predicted(1), complete(4, unindexed_hit_age_ms=200), "index_lag"),
        (predicted(1), complete(4, unindexed_hit_age_ms=8000), "stale_index"),  # its Stored events got lost
    ],
)
def test_each_miss_has_its_cause(prediction, answer, cause):
    assert miss_cause(prediction, answer, BS, lag_tolerance_s=2.0) == cause


def decision(prompt_blocks: int, **matched) -> Decision:
    """A decision for a prompt of ``prompt_blocks`` full blocks and one token more."""
    tokens = list(range(prompt_blocks * BS + 1))
    return Decision("q", tokens, [], pb.SamplingParams(), [], {}, "prefix", 0.0, **matched)


def test_a_host_tiers_continuation_is_predicted_and_split_by_tier():
    d = decision(10, index_matched={"r0": 3, "r1": 6}, tiered_matched={"r0": 8, "r1": 6, "r2": 12})
    r0 = d.prediction("r0", 7, BS)
    assert (r0.index, r0.predicted, r0.host) == (3, 8, 5)  # 3 on its device, 5 more restored from its host
    assert r0.fleet_best == 10  # r2's 12 host blocks, capped at what a replica can reuse
    assert miss_cause(r0, complete(8), BS, lag_tolerance_s=2.0) is None  # restored blocks count as reused
    r1 = d.prediction("r1", 7, BS)
    assert (r1.predicted, r1.host) == (6, 0)
    r2 = d.prediction("r2", 7, BS)
    assert (r2.index, r2.predicted, r2.host) == (0, 10, 10)
    ahead = decision(10, index_matched={"r0": 3}, speculative_matched={"r0": 9}, tiered_matched={"r0": 5})
    assert (ahead.prediction("r0", 7, BS).predicted, ahead.prediction("r0", 7, BS).host) == (9, 0)


def test_prediction_error_is_signed_in_blocks():
    assert predicted(5).error(complete(2), BS) == 3
    assert predicted(1).error(complete(4), BS) == -3


def test_lies_degrade_then_stop_the_index_and_a_new_incarnation_clears_them():
    config = IndexTrustConfig(window=10, min_samples=4, degraded_rate=0.25, load_only_rate=0.6)
    h = ReplicaTrust(config, incarnation=1)
    changes = [h.record(c, 1, now=float(i)) for i, c in enumerate([None, None, None, "stale_index"])]
    assert changes[:3] == [None, None, None] and changes[3] == (DEGRADED, "stale_index")
    for i in range(4):
        h.record("stale_index", 1, now=10.0 + i)
    assert (h.state, h.cause) == (LOAD_ONLY, "stale_index")
    assert h.record(None, 2, now=20.0) == (EXACT, "")  # resynced or restarted: fresh window


def test_normal_misses_never_raise_an_alarm():
    h = ReplicaTrust(IndexTrustConfig(), incarnation=1)
    for i, cause in enumerate(["evicted", "index_lag", "speculative_unrealized", "replica_restarted"] * 10):
        assert h.record(cause, 1, now=float(i)) is None
    assert h.state == EXACT


def test_one_hash_mismatch_stops_the_index_until_it_leaves_the_window():
    h = ReplicaTrust(IndexTrustConfig(max_age_s=5.0), incarnation=1)
    assert h.record("hash_mismatch", 1, now=0.0) == (LOAD_ONLY, "hash_mismatch")
    assert h.record(None, 1, now=3.0) is None
    assert h.record(None, 1, now=6.0) == (EXACT, "")


def test_overall_state():
    assert overall_state([EXACT, EXACT], True) == EXACT
    assert overall_state([EXACT, LOAD_ONLY], True) == DEGRADED
    assert overall_state([LOAD_ONLY, LOAD_ONLY], True) == LOAD_ONLY
    assert overall_state([EXACT], False) == LOAD_ONLY


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="degraded_rate"):
        IndexTrustConfig(degraded_rate=0.8, load_only_rate=0.5)


def route(blocks: int) -> RouteRequest:
    return RouteRequest(list(range(blocks * BS + 1)), list(range(1, blocks + 1)))


@pytest.mark.parametrize(
    "states, branch",
    [
        ([ReplicaState("a", matched_blocks=4), ReplicaState("b")], "prefix_hit"),
        ([ReplicaState("a"), ReplicaState("b")], "load_fallback"),
        ([ReplicaState("a", matched_blocks=4, inflight_requests=12), ReplicaState("b")], "hot_spot_guard"),
        (
            [ReplicaState("a", matched_blocks=1, inflight_prefill_blocks=100), ReplicaState("b")],
            "load_over_prefix",
        ),
    ],
)
def test_prefix_policy_says_why_it_chose(states, branch):
    policy = PrefixAware()
    ranked = policy.rank(route(4), states)
    assert policy.branch(route(4), states, ranked[0]) == branch
