"""Routing policies: pure functions of (request, replica states) -> replicas in preference order.

No I/O here, so the same classes run in the router and in the simulator. A policy returns
every candidate ranked; the router tries the first and fails over to the next.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import xxhash

from kvmesh.kvcache.hashing import token_buffer
from kvmesh.serving.errors import shown
from kvmesh.serving.step_costs import PRIOR, PRIOR_RESTORE_BLOCK_S, StepCosts


@dataclass(frozen=True)
class RouteRequest:
    token_ids: Sequence[int]
    block_hashes: Sequence[int]  # the prompt's full-block hash chain
    max_tokens: int = 16
    affinity_key: str = ""  # a session or conversation key (a hint to the prefix policy)

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
    tiered_blocks: int = 0  # leading prompt blocks it holds counting its host tier (index)
    inflight_requests: int = 0  # routed by this router and not finished
    inflight_prefill_blocks: float = 0.0  # their uncached prefill not yet done (no first token yet)
    inflight_decode_blocks: float = 0.0  # their decode work (max_tokens), until they end
    num_running: int = 0  # from its heartbeat (all routers' requests)
    num_waiting: int = 0
    recent_blocks: float = 0.0  # blocks of new prefixes placed on it lately (decaying), for tie-breaks
    costs: StepCosts = PRIOR  # what a step costs there, measured (its heartbeat)
    restore_block_s: float = PRIOR_RESTORE_BLOCK_S  # restoring one block from its host tier there
    step_tokens: int = DEFAULT_STEP_TOKENS  # tokens one of its steps computes at most (chunked prefill)
    share_alarm: bool = False  # it took far over its fair share lately (``router/share_alarm.py``)

    @property
    def load(self) -> int:
        return self.inflight_requests + self.num_waiting

    def held_blocks(self, prompt_blocks: int) -> int:
        """Leading prompt blocks it holds in either tier."""
        return min(max(self.matched_blocks, self.tiered_blocks), prompt_blocks)

    def restored_blocks(self, prompt_blocks: int) -> int:
        """Of those, the blocks it would restore from its host tier."""
        return self.held_blocks(prompt_blocks) - min(self.matched_blocks, prompt_blocks)

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


@dataclass(frozen=True)
class FleetTerms:
    """What one prefix decision compares every replica against (``PrefixAware.fleet``)."""

    cap: float  # the hot-spot guard's in-flight cap
    prefill_s: float  # the recompute term's price of a prompt token: the replicas' median
    tick_s: float  # scores closer than this may tie: ``tie_steps`` of the median base step


# Full chunked-prefill steps of queued prefill past which a holder's cache stops earning it the
# request: far out, because spilling sooner copied long prefixes the caches had no room for and
# won no p90 TTFT (docs/design.md, "saturated").
SATURATION_STEPS = 32.0


@dataclass
class PrefixAware(Policy):
    """Routes by predicted time to first token (TTFT) plus what a recomputed prefix costs the
    fleet; a holder keeps its prefix until it is saturated; a hot-spot guard and the share
    alarm bound what any one replica takes.

    On each replica, priced by its step costs as ``router/pricing.py`` bounds them (like
    hardware alike)::

        ttft  = wait + step + restored * restore_block + uncached * prefill_token
        wait  = queued * prefill_token + queued / step_tokens * step
        step  = base + decode_seq * requests in flight there
        score = ttft + recompute_weight * billed * fleet_prefill_token

    ``queued``: the prefill tokens routed to it and not yet computed (every router's, with
    shared load), which its scheduler serves first; ``uncached``: the prompt tokens it does
    not hold. So a prompt nobody holds goes to the replica with the least uncached work in
    flight, this prompt's included (llm-d's lookahead), in seconds at its own price: a replica
    twice as slow gets half the cold work under saturation. ``restored``: the blocks its host
    tier holds past its device's, which its engine copies back before the prefill, at the
    restore time per block it measured (so a slow host link makes a host hit worth less than
    a device hit, and a fast one nearly as much), where llm-d and Dynamo weigh a host hit by
    a fixed factor.

    ``recompute_weight``: a prompt computed where it is not cached costs more than this
    request's wait: its prefill delays every request queued behind it there, and its copy
    displaces other prefixes from that cache (docs/experiments.md, "Pricing": 3-31 keep every
    simulated hit rate, 0 loses up to 14 points). It is charged at the fleet's median prompt
    token price, not the replica's own: charged at its own, a price difference was multiplied
    16 times into where every cold prompt went, and a replica whose fit came out cheap for a
    few seconds took them all (issue 49). ``billed``: the uncached tokens, or the whole prompt
    on a replica that is **saturated** (its queued prefill is more than ``saturation_steps``
    full chunked-prefill steps there, i.e. its queue delay is that many full steps at its own
    prefill rate): a holder keeps its prefix until then, and then the prefix spills to the
    next-best replica by load, which becomes a second holder.

    Guards, before the score: a replica holding more than ``hot_spot_factor`` times its fair
    share of in-flight requests (+ ``hot_spot_slack``) is used only if all are; a replica
    whose share alarm is on (``router/share_alarm.py``) gets no prompt it would compute from
    scratch while another can take it. On replicas priced apart, a prompt nobody holds is
    scored in ticks of ``tie_steps`` base steps (``ticks``), so replicas near idle tie; equal
    scores go by the request's session key (rendezvous: a conversation's first turn
    lands where its key points, and its later turns break ties the same way) or, without one,
    to the replica with the fewest new prefixes placed on it lately (``ReplicaLoad``), then by
    rendezvous hashing of the first block.
    """

    block_size: int = 16
    recompute_weight: float = 15.0
    # 1.25 x + 2 moved shared prefixes off their holder in small bursts (cold copies elsewhere);
    # 1.5 x + 3 raised every simulated hit rate without a worse tail (docs/experiments.md)
    hot_spot_factor: float = 1.5
    hot_spot_slack: float = 3.0
    saturation_steps: float = SATURATION_STEPS
    tie_steps: float = 2.0  # scores are compared in ticks of this many base steps (``ticks``)
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

    def saturated(self, r: ReplicaState) -> bool:
        """Whether ``r``'s queued prefill takes more than ``saturation_steps`` full steps of
        its chunked prefill (the same at any price: both sides are its own prefill rate)."""
        return r.inflight_prefill_blocks * self.block_size > self.saturation_steps * r.step_tokens

    def uncached_tokens(self, request: RouteRequest, r: ReplicaState) -> int:
        return (request.num_blocks - r.held_blocks(request.num_blocks)) * self.block_size

    def restore_seconds(self, request: RouteRequest, r: ReplicaState) -> float:
        """Copying back the blocks of ``request`` that only ``r``'s host tier holds."""
        return r.restored_blocks(request.num_blocks) * r.restore_block_s

    def load_seconds(self, r: ReplicaState) -> float:
        """What any prompt waits for on ``r`` before its own prefill: the queue and one step."""
        step_s = self.step_seconds(r)
        return self.wait_seconds(r, step_s) + step_s

    def ttft(self, request: RouteRequest, r: ReplicaState) -> float:
        """Predicted seconds to ``request``'s first token on ``r``."""
        return (
            self.load_seconds(r)
            + self.restore_seconds(request, r)
            + self.uncached_tokens(request, r) * r.costs.prefill_token_s
        )

    def billed_tokens(self, request: RouteRequest, r: ReplicaState) -> int:
        """The prompt tokens the recompute term charges on ``r``: all of them where it is
        saturated (its cache no longer earns it the request)."""
        return request.num_blocks * self.block_size if self.saturated(r) else self.uncached_tokens(request, r)

    def score(self, request: RouteRequest, r: ReplicaState, fleet_prefill_s: float) -> float:
        """What sending ``request`` to ``r`` costs, in seconds: lower is better.
        ``fleet_prefill_s``: what the recompute term charges a prompt token (``FleetTerms``)."""
        return self.priced(
            self.load_seconds(r) + self.restore_seconds(request, r),
            self.uncached_tokens(request, r),
            r.costs.prefill_token_s,
            self.billed_tokens(request, r),
            fleet_prefill_s,
        )

    def priced(
        self, load_s: float, uncached: int, prefill_s: float, billed: int, fleet_prefill_s: float
    ) -> float:
        """The score from its parts (the simulator's fast path adds them up the same way)."""
        return load_s + uncached * prefill_s + self.recompute_weight * billed * fleet_prefill_s

    def fleet(self, replicas: Sequence[ReplicaState]) -> FleetTerms:
        """What a decision compares every replica against, from ``replicas`` (the fleet): ticks
        only where the replicas are priced apart (``ticks``)."""
        prices = [r.costs.prefill_token_s for r in replicas]
        apart = max(prices) > min(prices)
        return FleetTerms(
            self.cap(replicas),
            statistics.median(prices),
            self.tie_steps * statistics.median(r.costs.base_s for r in replicas) if apart else 0.0,
        )

    def cap(self, replicas: Sequence[ReplicaState]) -> float:
        """The guard's cap: the fair share of in-flight requests (this one included) times the factor."""
        return self.cap_of(sum(r.inflight_requests for r in replicas), len(replicas))

    def cap_of(self, inflight_requests: int, num_replicas: int) -> float:
        return self.hot_spot_factor * (inflight_requests + 1) / num_replicas + self.hot_spot_slack

    def sort_key(
        self, request: RouteRequest, r: ReplicaState, fleet: FleetTerms
    ) -> tuple[bool, bool, float, int]:
        """Where ``r`` ranks for ``request``, lower first, before the rendezvous tie-break:
        over the guard's cap, then held back by its share alarm (a prompt it would compute
        from scratch), then the score in whole ticks, then the new prefixes placed there
        lately (not with a session key: the key's rendezvous breaks the tie). The one statement
        of the order: the simulator's fast path ranks by its parts too."""
        return (
            self.over_cap(r.inflight_requests, fleet.cap),
            self.held_back(request, r),
            self.ticks(self.score(request, r, fleet.prefill_s), fleet.tick_s),
            0 if request.affinity_key else self.recent_rank(r.recent_blocks),
        )

    @staticmethod
    def ticks(score: float, tick_s: float) -> float:
        """A score as the order compares it: in whole ticks, so that scores a few ms apart tie
        and the tie-breaks spread them. Used for prompts nobody holds on replicas priced apart,
        where part of what tells two scores apart is a fitted price no finer than a step; on
        replicas priced alike the scores differ by the router's own counts of queued work, and
        ticks there only moved cold prompts off the least-loaded replica (docs/design.md)."""
        return math.floor(score / tick_s) if tick_s > 0 else score

    def held_back(self, request: RouteRequest, r: ReplicaState) -> bool:
        """Whether ``r``'s share alarm keeps ``request`` away: it would compute it from scratch
        (holds none of it, or is saturated)."""
        return r.share_alarm and (r.held_blocks(request.num_blocks) == 0 or self.saturated(r))

    @staticmethod
    def over_cap(inflight_requests: int, cap: float) -> bool:
        """Whether one more request would put a replica over the guard's cap."""
        return inflight_requests + 1 > cap

    @staticmethod
    def recent_rank(recent_blocks: float) -> int:
        """Recent new prefixes, as the order compares them (whole blocks: near-equal is a tie)."""
        return round(recent_blocks)

    def rank(self, request, replicas, fleet: FleetTerms | None = None):
        """``fleet``: the fleet's terms, when ``replicas`` is a subset of it (the simulator
        passes only the replicas that can come first); by default, from ``replicas``."""
        fleet = self.fleet(replicas) if fleet is None else fleet
        if any(r.held_blocks(request.num_blocks) for r in replicas):
            fleet = replace(fleet, tick_s=0.0)  # a holder's edge is exact; ticks spread cold prompts
        if request.affinity_key:
            key = request.affinity_key.encode()
        elif request.num_blocks:
            key = request.block_hashes[0].to_bytes(8, "little")
        else:
            key = bytes(token_buffer(request.token_ids[:64]))
        tiebreak = {r.replica_id: i for i, r in enumerate(rendezvous(key, replicas))}
        ordered = sorted(replicas, key=lambda r: (*self.sort_key(request, r, fleet), tiebreak[r.replica_id]))
        return [r.replica_id for r in ordered]

    def branch(self, request, replicas, chosen):
        """prefix_hit: it holds the deepest prefix; load_fallback: nobody holds any;
        hot_spot_guard: every deepest holder was over the guard's cap; spill: every deepest
        holder was saturated or over the cap, one at least saturated; load_over_prefix: a
        deeper holder scored worse (its queue outweighed the prefill saved)."""
        depth = {r.replica_id: r.held_blocks(request.num_blocks) for r in replicas}
        best = max(depth.values())
        if best == 0:
            return "load_fallback"
        if depth[chosen] == best:
            return "prefix_hit"
        cap = self.cap(replicas)
        holders = [r for r in replicas if depth[r.replica_id] == best]
        if all(self.over_cap(r.inflight_requests, cap) for r in holders):
            return "hot_spot_guard"
        if all(self.over_cap(r.inflight_requests, cap) or self.saturated(r) for r in holders):
            return "spill"
        return "load_over_prefix"


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (PrefixAware, RoundRobin, LeastLoaded, PowerOfTwo, RandomChoice, ConsistentHash)
}


def make_policy(
    name: str, block_size: int = 16, seed: int | None = None, saturation_steps: float = SATURATION_STEPS
) -> Policy:
    """A policy by name; ``ValueError`` naming the known ones otherwise."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {shown(name)}; known: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    if cls in (RandomChoice, PowerOfTwo):
        return cls(seed=seed)
    if cls is PrefixAware:
        return cls(block_size=block_size, saturation_steps=saturation_steps)
    if cls is ConsistentHash:
        return cls(block_size=block_size)
    return cls()
