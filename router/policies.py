"""Routing policies: pure functions of (request, replica states) -> replicas in preference order.

No I/O here, so the same classes run in the router and in the simulator. A policy returns
every candidate ranked; the router tries the first and fails over to the next.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from kvmesh.kvcache.hashing import token_buffer
from kvmesh.serving.errors import shown
from kvmesh.serving.step_costs import PRIOR, StepCosts


@dataclass(frozen=True)
class RouteRequest:
    token_ids: Sequence[int]
    block_hashes: Sequence[int]  # the prompt's full-block hash chain
    max_tokens: int = 16
    affinity_key: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


# A replica's chunked-prefill budget when its record does not say (replica/config.py's default).
DEFAULT_STEP_TOKENS = 2048


@dataclass
class ReplicaState:
    """What the router knows about one live replica when it decides."""

    replica_id: str
    matched_blocks: int = 0  # leading prompt blocks it holds (index + speculative)
    inflight_requests: int = 0  # routed by this router and not finished
    inflight_prefill_blocks: float = 0.0  # their uncached prefill not yet done (no first token yet)
    inflight_decode_blocks: float = 0.0  # their decode work (max_tokens), until they end
    num_running: int = 0  # from its heartbeat (all routers' requests)
    num_waiting: int = 0
    recent_blocks: float = 0.0  # blocks of new prefixes placed on it lately (decaying), for tie-breaks
    costs: StepCosts = PRIOR  # what a step costs there, measured (its heartbeat)
    step_tokens: int = DEFAULT_STEP_TOKENS  # tokens one of its steps computes at most (chunked prefill)

    @property
    def load(self) -> int:
        return self.inflight_requests + self.num_waiting

    @property
    def inflight_blocks(self) -> float:
        return self.inflight_prefill_blocks + self.inflight_decode_blocks


def rendezvous(key: bytes, replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """Highest-random-weight order: stable per key, moves only 1/n of keys when n changes."""
    return sorted(replicas, key=lambda r: xxhash.xxh64_intdigest(key + r.replica_id.encode()), reverse=True)


class Policy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def rank(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> list[str]:
        """Replica ids, best first. ``replicas`` is non-empty."""

    def branch(self, request: RouteRequest, replicas: Sequence[ReplicaState], chosen: str) -> str:
        """Why ``chosen`` came first, for the decisions-by-branch metric."""
        return "policy_order"


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, request, replicas):
        ids = sorted(r.replica_id for r in replicas)
        k = next(self._counter) % len(ids)
        return ids[k:] + ids[:k]


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, request, replicas):
        ids = [r.replica_id for r in replicas]
        self._rng.shuffle(ids)
        return ids


def _by_load(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    return sorted(replicas, key=lambda r: (r.load, r.inflight_blocks, r.num_running, r.replica_id))


class LeastLoaded(Policy):
    name = "least_loaded"

    def rank(self, request, replicas):
        return [r.replica_id for r in _by_load(replicas)]


class PowerOfTwo(Policy):
    """Two random candidates, the less loaded first (then everyone else by load)."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, request, replicas):
        pair = self._rng.sample(list(replicas), k=min(2, len(replicas)))
        first = [r.replica_id for r in _by_load(pair)]
        return first + [r.replica_id for r in _by_load(replicas) if r.replica_id not in first]


class ConsistentHash(Policy):
    """Rendezvous hashing on the first ``prefix_blocks`` blocks (or tokens, for short prompts)."""

    name = "consistent_hash"

    def __init__(self, prefix_blocks: int = 4, block_size: int = 16) -> None:
        self.prefix_blocks = prefix_blocks
        self.block_size = block_size

    def rank(self, request, replicas):
        if request.num_blocks >= self.prefix_blocks:
            key = request.block_hashes[self.prefix_blocks - 1].to_bytes(8, "little")
        else:
            key = bytes(token_buffer(request.token_ids[: self.prefix_blocks * self.block_size]))
        return [r.replica_id for r in rendezvous(key, replicas)]


class Session(Policy):
    """Same ``affinity_key`` -> same replica (rendezvous); no key -> least loaded."""

    name = "session"

    def rank(self, request, replicas):
        if not request.affinity_key:
            return LeastLoaded().rank(request, replicas)
        return [r.replica_id for r in rendezvous(request.affinity_key.encode(), replicas)]


@dataclass
class PrefixAware(Policy):
    """Routes by predicted time to first token (TTFT) plus what a recomputed prefix costs the
    fleet, under a bounded-load hot-spot guard.

    On each replica, priced by that replica's own measured step costs (its heartbeat; like
    replicas at their median, see ``router/registry.py``)::

        ttft  = wait + step + uncached * prefill_token
        wait  = queued * prefill_token + queued / step_tokens * step
        step  = base + decode_seq * requests in flight there
        score = ttft + recompute_weight * uncached * prefill_token

    ``queued``: the prefill tokens routed to it and not yet computed (every router's, with
    shared load), which its scheduler serves first; ``uncached``: the prompt tokens it does
    not hold. A replica twice as slow prices everything twice as high, so under saturation it
    gets half the work of one twice as fast.

    ``recompute_weight``: a prompt computed where it is not cached costs more than this
    request's wait. The time its prefill takes delays every request that queues behind it
    there, and the copy it makes displaces other prefixes from that cache; both fall on
    later requests, which a request's own TTFT does not see. Charged as 15 more times the
    prefill's own time, measured in the simulator (docs/experiments.md, "Pricing"): at 0 (pure
    TTFT) the shared-prefix suite loses up to 14 points of hit rate and its p90 TTFT rises
    4.8x; 1 loses 1.2 points of hit rate on Mooncake (8 replicas) and has a worse p90 on the
    hot-spot and cache-pressure cells; 3-31 keep every hit rate, 15 the best on Mooncake. A burst
    on one prefix stays on its holder until waiting there costs more than 16 times the prefill
    it saves.

    Guard: a replica already holding more than ``hot_spot_factor`` times its fair share of
    in-flight requests (+ ``hot_spot_slack``) is only used if all are that busy, so one
    shared system prompt can never pile every request on one replica while predictions lag
    (costs and queues are as of the last heartbeat and reservation). Equal scores (a prefix
    nobody holds, like replicas idle) go to the replica that had the fewest new prefixes
    placed on it lately (by blocks, ``ReplicaLoad``), then by rendezvous hashing of the
    first block: at low load a stream of cold prompts spreads evenly (more distinct
    prefixes stay cached), and repeat visits agree.
    """

    block_size: int = 16
    recompute_weight: float = 15.0
    # 1.25 x + 2 moved shared prefixes off their holder in small bursts (cold copies elsewhere);
    # 1.5 x + 3 raised every simulated hit rate without a worse tail (docs/experiments.md)
    hot_spot_factor: float = 1.5
    hot_spot_slack: float = 3.0
    name: ClassVar[str] = "prefix"

    def step_seconds(self, r: ReplicaState) -> float:
        """One step on ``r`` now, before any prompt tokens: a sequence for each request in
        flight there as this router counts them (every router's, with shared load). Not the
        heartbeat's running sequences or context: those are up to a heartbeat old and the same
        for every router, so pricing by them sends every router's cold prompts to the replica
        that looked idlest at the last heartbeat (measured: without shared load, Mooncake on
        64 replicas x 16 routers fell from 0.62 to 0.41 hit rate and p90 TTFT rose 6x;
        docs/experiments.md, "Many routers")."""
        return r.costs.step_seconds(0, r.inflight_requests, 0)

    def wait_seconds(self, r: ReplicaState, step_s: float) -> float:
        """Until ``r`` has computed the prefill queued there."""
        queued = r.inflight_prefill_blocks * self.block_size
        return queued * r.costs.prefill_token_s + queued / r.step_tokens * step_s

    def uncached_tokens(self, request: RouteRequest, r: ReplicaState) -> int:
        return (request.num_blocks - min(r.matched_blocks, request.num_blocks)) * self.block_size

    def ttft(self, request: RouteRequest, r: ReplicaState) -> float:
        """Predicted seconds to ``request``'s first token on ``r``."""
        step_s = self.step_seconds(r)
        return (
            self.wait_seconds(r, step_s) + step_s + self.uncached_tokens(request, r) * r.costs.prefill_token_s
        )

    def score(self, request: RouteRequest, r: ReplicaState) -> float:
        """What sending ``request`` to ``r`` costs, in seconds: lower is better."""
        recompute = self.recompute_weight * self.uncached_tokens(request, r) * r.costs.prefill_token_s
        return self.ttft(request, r) + recompute

    def cap(self, replicas: Sequence[ReplicaState]) -> float:
        """The guard's cap: the fair share of in-flight requests (this one included) times the factor."""
        return self.cap_of(sum(r.inflight_requests for r in replicas), len(replicas))

    def cap_of(self, inflight_requests: int, num_replicas: int) -> float:
        return self.hot_spot_factor * (inflight_requests + 1) / num_replicas + self.hot_spot_slack

    def sort_key(self, request: RouteRequest, r: ReplicaState, cap: float) -> tuple[bool, float, int]:
        """Where ``r`` ranks for ``request``, lower first, before the rendezvous tie-break:
        over the guard's cap, then the score, then the new prefixes placed there lately. The
        one statement of the order: the simulator's fast path ranks by its parts too."""
        return (
            self.over_cap(r.inflight_requests, cap),
            self.score(request, r),
            self.recent_rank(r.recent_blocks),
        )

    @staticmethod
    def over_cap(inflight_requests: int, cap: float) -> bool:
        """Whether one more request would put a replica over the guard's cap."""
        return inflight_requests + 1 > cap

    @staticmethod
    def recent_rank(recent_blocks: float) -> int:
        """Recent new prefixes, as the order compares them (whole blocks: near-equal is a tie)."""
        return round(recent_blocks)

    def rank(self, request, replicas, cap: float | None = None):
        """``cap``: the guard's cap when ``replicas`` is a subset of the fleet (the simulator
        passes only the replicas that can come first); by default, from ``replicas``."""
        cap = self.cap(replicas) if cap is None else cap
        key = (
            request.block_hashes[0].to_bytes(8, "little")
            if request.num_blocks
            else bytes(token_buffer(request.token_ids[:64]))
        )
        tiebreak = {r.replica_id: i for i, r in enumerate(rendezvous(key, replicas))}
        ordered = sorted(replicas, key=lambda r: (*self.sort_key(request, r, cap), tiebreak[r.replica_id]))
        return [r.replica_id for r in ordered]

    def branch(self, request, replicas, chosen):
        """prefix_hit: it holds the deepest prefix; load_fallback: nobody holds any;
        hot_spot_guard: every deepest holder was over the guard's cap; load_over_prefix:
        a deeper holder scored worse (its queue outweighed the prefill saved)."""
        depth = {r.replica_id: min(r.matched_blocks, request.num_blocks) for r in replicas}
        best = max(depth.values())
        if best == 0:
            return "load_fallback"
        if depth[chosen] == best:
            return "prefix_hit"
        cap = self.cap(replicas)
        holders = [r for r in replicas if depth[r.replica_id] == best]
        return "hot_spot_guard" if all(r.inflight_requests + 1 > cap for r in holders) else "load_over_prefix"


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (PrefixAware, RoundRobin, LeastLoaded, PowerOfTwo, RandomChoice, ConsistentHash, Session)
}


def make_policy(name: str, block_size: int = 16, seed: int | None = None) -> Policy:
    """A policy by name; ``ValueError`` naming the known ones otherwise."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {shown(name)}; known: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    if cls in (RandomChoice, PowerOfTwo):
        return cls(seed=seed)
    if cls in (ConsistentHash, PrefixAware):
        return cls(block_size=block_size)
    return cls()
