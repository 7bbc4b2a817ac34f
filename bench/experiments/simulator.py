"""Discrete-event simulation of a kvmesh cluster: 1,000s of replicas, millions of requests,
one or many routers.

What is real here, not modelled: each replica's ``BlockManager`` and ``Scheduler`` (the
engine's own classes: continuous batching, chunked prefill, prefix reuse, preemption by
recompute; the scheduler with its steady decoders parked, ``LazyDecodeScheduler``), the hash
contract, the routing policy objects, the speculative entries and the
routers' in-flight accounting. What is modelled: time (``CostModel`` per engine iteration),
the index (fed by the ledgers' KV events, ``event_lag_s`` after the iteration that made
them) and the replicas' heartbeats (queue lengths seen every ``heartbeat_s``; 0: live).

Routers: request i goes to router i mod ``routers``. Each router runs its own policy object
and keeps its own counts of what it sent, its own recent-work tie-breaks and its own share
alarm (``ShareAlarm``, judged every ``fit_every_s``). With
``shared_load`` every router sees the fleet's in-flight work and every router's speculative
entries (what the index carries; the reservation's round trip to Redis is not modelled);
without it, each sees only its own.

Hardware: every replica runs the one cost model unless ``speeds``, ``fit_noise`` or ``drift``
say otherwise (``FleetHardware``): then each replica's steps take its own (true) time, and the
routers price it as the router's ``FleetPrices`` prices the fits it sees (noisy), updated every
``fit_every_s`` (the same for every router: they read the same records).

Speed and memory: the workload is read as an iterator in arrival order (generated or read
as the clock reaches it), a request in flight keeps its tokens 4 bytes each, and a finished
one leaves one row of numbers, so memory is bounded by what is in flight and cached, not by
the trace's length. An engine step touches only the requests at a boundary (a block filled
or needed, the last token), the one prefilling and the admissions (``LazyDecodeScheduler``),
so what a step costs does not grow with the batch; steps that touch nobody run as one
"window" (closed-form duration) up to the next boundary or arrival. A prefix-policy decision
does not rank every replica when every replica is priced alike (one cost model): those
holding nothing of the prompt differ only by load (their scores are the load part plus the
same prefill); each router keeps them ordered by the load part (``LoadOrder``), and the policy
ranks the holders plus the cheapest tied non-holders; the choice is the one the full ranking
makes (tested). Priced per replica, every decision ranks every replica.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from array import array
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from kvmesh.bench.experiments.cost_model import CostModel, FleetHardware
from kvmesh.bench.experiments.lazy_scheduler import LazyDecodeScheduler
from kvmesh.bench.measure.stats import percentile
from kvmesh.bench.measure.workloads import WorkloadRequest
from kvmesh.engine.request import Request
from kvmesh.engine.scheduler import Scheduler
from kvmesh.kvcache import BlockManager, block_hashes, namespace_seed
from kvmesh.kvcache.host_pool import HostPool
from kvmesh.kvcache.index.memory import MemoryPrefixIndex
from kvmesh.router.config import BalanceConfig
from kvmesh.router.policies import FleetTerms, Policy, PrefixAware, ReplicaState, RouteRequest, make_policy
from kvmesh.router.pricing import MeasuredReplica
from kvmesh.router.replica_load import ReplicaLoad, RequestWork
from kvmesh.router.share_alarm import ShareAlarm
from kvmesh.router.speculative import SpeculativeOverlay
from kvmesh.serving.sampling_params import SamplingParams
from kvmesh.serving.step_costs import StepCosts

_NO_BLOCKS = RouteRequest((), ())  # a policy's score of it is the load part alone (at any fleet price)


@dataclass
class SimRequest:
    """A request in flight (dropped when it finishes: only its ``Results`` row stays)."""

    request: Request
    replica: int
    router: int
    work: RequestWork  # what its router counts
    fleet_work: RequestWork  # what the fleet's shared counts hold (paid off separately)
    predicted_tokens: int
    answer: list[int]  # what it samples; past the end (or with none), a made-up stream
    first_token_s: float | None = None

    def sampled(self, count: int) -> list[int]:
        """The ``count`` tokens it samples next."""
        k = self.request.num_completion_tokens
        made_up = [(k + j) % 997 + 3 for j in range(max(0, len(self.answer) - k), count)]
        return self.answer[k : k + count] + made_up


class Results:
    """One row of numbers per finished request, in typed columns (1M requests: ~60 MB)."""

    FLOATS = ("arrival_s", "first_token_s", "done_s")
    INTS = (
        "replica",
        "prompt_tokens",
        "cached_tokens",
        "host_cached_tokens",
        "predicted_tokens",
        "completion_tokens",
    )

    def __init__(self) -> None:
        self.columns = {name: array("d") for name in self.FLOATS} | {name: array("q") for name in self.INTS}

    def add(self, record: SimRequest, done_s: float) -> None:
        r, c = record.request, self.columns
        c["arrival_s"].append(r.arrival_time)
        c["first_token_s"].append(record.first_token_s)
        c["done_s"].append(done_s)
        c["replica"].append(record.replica)
        c["prompt_tokens"].append(r.num_prompt_tokens)
        c["cached_tokens"].append(r.cached_prompt_tokens or 0)
        c["host_cached_tokens"].append(r.host_cached_prompt_tokens)
        c["predicted_tokens"].append(record.predicted_tokens)
        c["completion_tokens"].append(r.num_completion_tokens)

    def __getitem__(self, name: str) -> array:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.columns["done_s"])


class LoadOrder:
    """One router's replicas sorted by (load part of its policy's score, recent work): the
    order its prefix policy ranks replicas that hold nothing of a prompt, kept up to date as
    loads change (a sorted list: an update moves one entry, in C)."""

    def __init__(self, num_replicas: int):
        self.keys = [(0.0, -math.inf, r) for r in range(num_replicas)]
        self.sorted = sorted(self.keys)

    def update(self, replica: int, cost: float, recent_key: float) -> None:
        new = (cost, recent_key, replica)
        old = self.keys[replica]
        if new != old:
            del self.sorted[bisect_left(self.sorted, old)]
            insort(self.sorted, new)
            self.keys[replica] = new


@dataclass
class RouterView:
    """What one router knows and runs: its policy object, its counts of what it sent each
    replica (and their recent-work tie-breaks), its speculative entries (the fleet's, with
    shared load), its share alarm and, for a prefix policy priced alike, its ``LoadOrder``."""

    index: int
    policy: Policy
    own: list[ReplicaLoad]
    overlay: SpeculativeOverlay
    order: LoadOrder | None
    alarm: ShareAlarm
    inflight: int = 0  # requests it sent that have not finished


class ColdShares:
    """The prompts nobody held any of (cold prompts) each replica got, per window of arrivals:
    a policy that piles them on one replica shows here before it shows in any mean. Only
    windows with ``MIN_PROMPTS`` or more count (a few cold prompts are never fair)."""

    MIN_PROMPTS = 8

    def __init__(self, replicas: int, window_s: float):
        if window_s <= 0:
            raise ValueError(f"the cold-prompt window must be positive, got {window_s}")
        self.window_s = window_s
        self.counts = [0] * replicas
        self._window = 0
        self._worst = 0.0

    def add(self, replica: int, now: float) -> None:
        window = int(now // self.window_s)
        if window != self._window:
            self._worst = self.worst()
            self.counts = [0] * len(self.counts)
            self._window = window
        self.counts[replica] += 1

    def worst(self) -> float:
        """The most cold prompts one replica got in a window, over its fair share of them."""
        total = sum(self.counts)
        if total < self.MIN_PROMPTS:
            return self._worst
        return max(self._worst, max(self.counts) * len(self.counts) / total)


@dataclass
class _Window:
    """k identical decode iterations in flight, started at ``start``."""

    start: float
    steps: int
    batch: int
    context: int  # context tokens of the batch at the first step
    cost: StepCosts  # its replica's, when it started

    def duration(self, steps: int) -> float:
        cost = self.cost
        per = cost.base_s + cost.decode_seq_s * self.batch
        return steps * per + cost.context_token_s * (
            steps * self.context + self.batch * steps * (steps - 1) / 2
        )


@dataclass
class SimReplica:
    index: int
    bm: BlockManager
    scheduler: Scheduler  # a LazyDecodeScheduler unless the simulation runs every step in full
    cost: StepCosts  # what its steps take
    busy: bool = False
    version: int = 0  # invalidates stale wake-ups
    scheduled: list = field(default_factory=list)
    window: _Window | None = None
    step_end: float = 0.0
    prefill_tokens: int = 0  # uncached prompt tokens computed here (load balance metric)
    steps: int = 0  # steps it ran (how much its fit has seen)


class Simulation:
    def __init__(
        self,
        workload: Iterable[WorkloadRequest],
        replicas: int,
        policy: str | Policy,
        cost: CostModel,
        block_size: int = 256,
        blocks_per_replica: int | None = None,
        host_blocks_per_replica: int = 0,  # a host tier of this many blocks in every replica (0: none)
        speculative_ttl_s: float = 2.0,
        seed: int = 0,
        progress: Callable[[int], object] | None = None,  # called with 1 per arrival
        lazy_decode: bool = True,  # False: the engine's own Scheduler, every request every step
        routers: int = 1,
        shared_load: bool = True,
        event_lag_s: float = 0.0,
        heartbeat_s: float = 0.0,
        rank_all: bool = False,  # rank every replica at every decision (the reference for LoadOrder)
        speeds: Sequence[float] | None = None,  # replica i's steps take speeds[i % len] x the model's
        fit_noise: float = 0.0,  # the fits routers see are off by up to this fraction either way
        drift: float = 0.0,  # replicas' speeds wander (log-speed std per square root of a minute)
        fit_every_s: float = 1.0,  # how often fits are drawn, prices updated and shares judged
        balance: BalanceConfig | None = None,  # the routers' pricing, saturation and share alarm
        window_s: float = 10.0,  # the window of arrivals ``cold_share_max_over_fair`` judges
    ):
        if replicas <= 0 or routers <= 0:
            raise ValueError("replicas and routers must be positive")
        if event_lag_s < 0 or heartbeat_s < 0:
            raise ValueError("event lag and heartbeat interval must not be negative")
        if fit_every_s <= 0:
            raise ValueError(f"fit_every_s must be positive, got {fit_every_s}")
        # A list is sorted here; an iterator must already be in arrival order (checked as read).
        self.workload = (
            sorted(workload, key=lambda r: r.arrival_s) if isinstance(workload, list) else workload
        )
        self.cost = cost
        balance = balance or BalanceConfig()
        varied = speeds is not None or fit_noise or drift
        self.hardware = (
            FleetHardware(cost, replicas, speeds or (1.0,), fit_noise, drift, seed) if varied else None
        )
        self.prices = balance.prices()
        self.priced = [cost.step_costs] * replicas  # what the routers price each replica at
        self.fit_every_s = fit_every_s
        self._next_tick = 0.0
        self.block_size = block_size
        self.seed_hash = namespace_seed("simulated-model", block_size)
        self._num_blocks = blocks_per_replica or max(1, cost.kv_tokens_per_replica // block_size)
        if host_blocks_per_replica < 0:
            raise ValueError(f"host_blocks_per_replica must not be negative, got {host_blocks_per_replica}")
        self._host_blocks = host_blocks_per_replica
        self.restore_block_s = cost.restore_token_s * block_size  # a block's copy either way
        self.replicas = [self._replica(i, lazy_decode) for i in range(replicas)]
        self._ids = [str(i) for i in range(replicas)]
        self.index = MemoryPrefixIndex()  # fed by every replica's events, read by every router
        self.fleet = [ReplicaLoad() for _ in range(replicas)] if shared_load else None
        self.fleet_inflight = 0
        self.routers = self._routers(routers, policy, seed, balance, speculative_ttl_s, shared_load, rank_all)
        self.event_lag_s = event_lag_s
        self.heartbeat_s = heartbeat_s
        self._lagged: deque[tuple[float, int, list]] = deque()  # (visible at, replica, KV events)
        self._beats: list[tuple[float, int]] = []  # (next heartbeat, replica)
        if heartbeat_s:
            self._beats = [((r + 0.5) / replicas * heartbeat_s, r) for r in range(replicas)]
            heapq.heapify(self._beats)
        # (running, waiting) as the routers last saw them (no policy reads free blocks)
        self._queues = [(0, 0)] * replicas
        self.results = Results()
        self.rejected = 0
        self.cold = ColdShares(replicas, window_s)
        self.share_alarms = 0  # times a router's share alarm turned on for a replica
        self._events: list[tuple[float, int, int, int]] = []  # (time, tiebreak, replica, version)
        self._tiebreak = 0
        self._active: dict[int, SimRequest] = {}  # id(Request) -> record
        self._progress = progress
        self._arrivals = 0
        self.events = 0  # arrivals, steps (or windows), index deliveries and heartbeats handled
        for r in range(replicas):  # an idle replica's score is not 0: one step
            self._reorder(r, self.routers)

    def _replica(self, i: int, lazy_decode: bool) -> SimReplica:
        cost = self.cost
        host = HostPool(self._host_blocks, self.block_size) if self._host_blocks else None
        bm = BlockManager(self._num_blocks, self.block_size, seed=self.seed_hash, host=host)
        limits = (bm, cost.max_num_seqs, cost.max_num_batched_tokens)
        lazy = lazy_decode and cost.max_num_seqs < cost.max_num_batched_tokens
        scheduler = LazyDecodeScheduler(*limits, self._sampled) if lazy else Scheduler(*limits)
        return SimReplica(i, bm, scheduler, cost.step_costs)

    def _routers(
        self, count, policy, seed, balance, speculative_ttl_s, shared_load, rank_all
    ) -> list[RouterView]:
        """``count`` routers' views: each its own policy (seeded apart), load and share alarm;
        one speculative overlay for all where they share load."""
        replicas, block_size = len(self.replicas), self.block_size
        shared_overlay = SpeculativeOverlay(ttl_s=speculative_ttl_s)
        views = []
        for k in range(count):
            p = (
                make_policy(policy, block_size, seed + k, balance.saturation_steps)
                if isinstance(policy, str)
                else policy
            )
            # Exactness of the load order: costs of power-of-two block sizes are exact binary
            # fractions, so adding the prefix term never merges two distinct loads into a tie.
            fast = (
                isinstance(p, PrefixAware)
                and not rank_all
                and self.hardware is None
                and block_size & (block_size - 1) == 0
            )
            overlay = shared_overlay if shared_load else SpeculativeOverlay(ttl_s=speculative_ttl_s)
            load = [ReplicaLoad() for _ in range(replicas)]
            views.append(
                RouterView(k, p, load, overlay, LoadOrder(replicas) if fast else None, balance.alarm())
            )
        return views

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict:
        arrivals: Iterator[WorkloadRequest] = iter(self.workload)
        upcoming = next(arrivals, None)
        last_arrival = -math.inf
        while True:
            t_arrival = upcoming.arrival_s if upcoming is not None else math.inf
            t_event = self._events[0][0] if self._events else math.inf
            t_index = self._lagged[0][0] if self._lagged else math.inf
            if min(t_arrival, t_event, t_index) == math.inf:
                break
            t_beat = self._beats[0][0] if self._beats else math.inf
            if self._next_tick <= min(t_arrival, t_event, t_index, t_beat):
                self._tick(self._next_tick)
                continue
            self.events += 1
            if t_index <= min(t_event, t_arrival, t_beat):
                _, r, events = self._lagged.popleft()
                self.index.apply(r, events)
            elif t_beat <= min(t_event, t_arrival):
                _, r = heapq.heappop(self._beats)
                heapq.heappush(self._beats, (t_beat + self.heartbeat_s, r))
                self._see_queues(self.replicas[r])
            elif t_event < t_arrival:
                t, _, r, version = heapq.heappop(self._events)
                replica = self.replicas[r]
                if version == replica.version:
                    self._finish_iteration(replica, t)
            else:
                if t_arrival < last_arrival:
                    raise ValueError(f"workload not in arrival order: {t_arrival} after {last_arrival}")
                last_arrival = t_arrival
                self._arrive(self._arrivals, upcoming, t_arrival)
                self._arrivals += 1
                upcoming = next(arrivals, None)
        return self.summary()

    def _tick(self, now: float) -> None:
        """Every ``fit_every_s``: new fits and prices (varied hardware), shares judged."""
        self._next_tick = now + self.fit_every_s
        if self.hardware is not None:
            self._price(now)
        for router in self.routers:
            self.share_alarms += sum(change.on for change in router.alarm.update(self._ids, now))

    def _price(self, now: float) -> None:
        """The replicas' fits drawn anew, priced by the router's ``FleetPrices``."""
        hardware = self.hardware
        hardware.tick(now)
        measured = [
            MeasuredReplica(self._ids[r], hardware.hardware(r), hardware.fits[r], replica.steps)
            for r, replica in enumerate(self.replicas)
        ]
        prices = self.prices.update(measured, now)
        self.priced = [prices[rid] for rid in self._ids]
        for r, replica in enumerate(self.replicas):
            replica.cost = hardware.true[r]

    def _wake(self, replica: SimReplica, at: float) -> None:
        replica.version += 1
        self._tiebreak += 1
        heapq.heappush(self._events, (at, self._tiebreak, replica.index, replica.version))

    # ------------------------------------------------------------------ what routers see

    def _seen(self, router: RouterView, r: int) -> ReplicaLoad:
        return self.fleet[r] if self.fleet is not None else router.own[r]

    def _state(self, router: RouterView, r: int, matched: int, now: float, tiered: int = 0) -> ReplicaState:
        load = self._seen(router, r)
        running, waiting = self._queues[r]
        return ReplicaState(
            self._ids[r],
            matched,
            tiered,
            load.requests,
            load.prefill_blocks,
            load.decode_blocks,
            running,
            waiting,
            recent_blocks=router.own[r].recent.value(now),
            costs=self.priced[r],
            step_tokens=self.cost.max_num_batched_tokens,
            share_alarm=self._ids[r] in router.alarm.on,
            restore_block_s=self.restore_block_s,
        )

    def _reorder(self, r: int, routers: Iterable[RouterView]) -> None:
        """Replica ``r``'s load changed as ``routers`` see it: move it in their load orders.
        The load part of the prediction depends on the counts a router sees and its policy
        only, so routers sharing both (shared load) price it once."""
        costs: dict[tuple[int, type], float] = {}
        for router in routers:
            if router.order is not None:
                seen = (id(self._seen(router, r)), type(router.policy))
                if seen not in costs:
                    state = self._state(router, r, 0, 0.0)
                    costs[seen] = router.policy.score(_NO_BLOCKS, state, state.costs.prefill_token_s)
                router.order.update(r, costs[seen], router.own[r].recent.order_key())

    def _affected(self, router: RouterView) -> Sequence[RouterView]:
        """The routers that see a change to ``router``'s counts."""
        return self.routers if self.fleet is not None else (router,)

    def _see_queues(self, replica: SimReplica) -> None:
        """The routers learn the replica's queue lengths (at a heartbeat, or live)."""
        queues = (len(replica.scheduler.running), len(replica.scheduler.waiting))
        if queues != self._queues[replica.index]:
            self._queues[replica.index] = queues
            self._reorder(replica.index, self.routers)

    def _queues_changed(self, replica: SimReplica) -> None:
        if not self.heartbeat_s:
            self._see_queues(replica)

    # ------------------------------------------------------------------ routing

    def _decide(
        self,
        router: RouterView,
        route: RouteRequest,
        matched: dict[int, int],
        tiered: dict[int, int],
        now: float,
    ) -> int:
        """``matched``: device (and speculative) depths; ``tiered``: depths counting host tiers
        (replicas in either hold some of the prompt)."""
        n = len(self.replicas)
        if router.order is None:
            states = [self._state(router, r, matched.get(r, 0), now, tiered.get(r, 0)) for r in range(n)]
            return int(router.policy.rank(route, states)[0])
        total = self.fleet_inflight if self.fleet is not None else router.inflight
        policy = router.policy
        # every replica's costs are the one model's: the fleet's medians are its own, and
        # replicas priced alike are scored exactly (``PrefixAware.fleet``)
        fleet = FleetTerms(policy.cap_of(total, n), self.cost.prefill_token_s, 0.0)
        held = matched.keys() | tiered.keys()
        candidates = [self._state(router, r, matched.get(r, 0), now, tiered.get(r, 0)) for r in held]
        for r in self._cheapest_others(router, route, held, fleet, now):
            candidates.append(self._state(router, r, 0, now))
        return int(policy.rank(route, candidates, fleet=fleet)[0])

    def _cheapest_others(
        self, router: RouterView, route: RouteRequest, matched: Collection[int], fleet: FleetTerms, now: float
    ) -> list[int]:
        """The replicas holding none of the prompt that the full ranking could put first: the
        cheapest of the first non-empty class of (over the guard's cap, held back by the share
        alarm), with every replica in the same tick of score (the policy's rank then breaks
        their ties). The key's parts are the policy's (``PrefixAware.sort_key``): the load order
        holds each replica's score of a prompt it holds nothing of (its load part: on such
        prompts replicas priced alike differ by that alone), a replica holding nothing is held
        back exactly when its alarm is on, and the guard is asked of the policy from the counts,
        without building a state. The score adds the prompt's prefill to the load part as the
        policy adds it up (``PrefixAware.priced``)."""
        policy, alarmed = router.policy, router.alarm.on
        tokens = route.num_blocks * self.block_size  # all uncached, all billed, on these replicas
        for guarded, held in itertools.product((True, False), repeat=2):
            tied, best = [], None
            for cost, _, r in router.order.sorted:
                if (
                    r in matched
                    or (guarded and policy.over_cap(self._seen(router, r).requests, fleet.cap))
                    or (held and self._ids[r] in alarmed)
                ):
                    continue
                score = policy.priced(cost, tokens, self.cost.prefill_token_s, tokens, fleet.prefill_s)
                key = policy.ticks(score, fleet.tick_s)
                if best is not None and key != best:
                    break
                best = key
                tied.append(r)
            if tied:
                return tied
        return []

    def _arrive(self, i: int, spec: WorkloadRequest, now: float) -> None:
        if self._progress:
            self._progress(1)
        tokens = spec.token_array()
        if -(-(len(tokens) + spec.max_tokens) // self.block_size) > self._num_blocks:
            self.rejected += 1
            return
        router = self.routers[i % len(self.routers)]
        hashes = block_hashes(tokens, self.block_size, self.seed_hash)
        matched = self.index.matches(hashes)
        tiered = self.index.tiered_matches(hashes) if self._host_blocks else {}
        for rid, depth in router.overlay.matched(hashes, now).items():
            if depth > matched.get(rid, 0):
                matched[rid] = depth
        route = RouteRequest(tokens, hashes, spec.max_tokens, spec.session)
        chosen = self._decide(router, route, matched, tiered, now)
        if not matched and not tiered:
            self.cold.add(chosen, now)
        replica = self.replicas[chosen]
        router.overlay.record(chosen, hashes, now)
        depth = max(matched.get(chosen, 0), tiered.get(chosen, 0))
        work = RequestWork.estimate(len(hashes), depth, spec.max_tokens, self.block_size)
        record = SimRequest(
            Request(
                str(i),
                tokens,
                self.block_size,
                SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True),
                None,
                frozenset(),
                None,
            ),
            chosen,
            router.index,
            work,
            replace(work),
            min(depth, (len(tokens) - 1) // self.block_size) * self.block_size,
            spec.answer_tokens(),
        )
        record.request.arrival_time = now
        record.request.block_hashes = hashes  # the same chain (the contract): not hashed again
        self._begin(router, record, now)
        self._active[id(record.request)] = record
        replica.scheduler.add(record.request)
        if replica.window is not None:
            self._split_window(replica, now)
        elif not replica.busy:
            self._plan(replica, now)
        self._queues_changed(replica)

    # ------------------------------------------------------------------ load accounting

    def _begin(self, router: RouterView, record: SimRequest, now: float) -> None:
        router.own[record.replica].begin(record.work, now)
        router.alarm.record(self._ids[record.replica], record.work, now)
        router.inflight += 1
        if self.fleet is not None:
            self.fleet[record.replica].begin(record.fleet_work, now)
            self.fleet_inflight += 1
        self._reorder(record.replica, self._affected(router))

    def _prefill_done(self, record: SimRequest) -> None:
        router = self.routers[record.router]
        router.own[record.replica].prefill_done(record.work)
        if self.fleet is not None:
            self.fleet[record.replica].prefill_done(record.fleet_work)
        self._reorder(record.replica, self._affected(router))

    def _end(self, record: SimRequest) -> None:
        router = self.routers[record.router]
        router.own[record.replica].end(record.work)
        router.inflight -= 1
        if self.fleet is not None:
            self.fleet[record.replica].end(record.fleet_work)
            self.fleet_inflight -= 1
        self._reorder(record.replica, self._affected(router))

    # ------------------------------------------------------------------ replica iterations

    def _sampled(self, request: Request, count: int) -> list[int]:
        return self._active[id(request)].sampled(count)

    def _plan(self, replica: SimReplica, now: float) -> None:
        """Schedule the next step (or the quiet steps up to the next boundary) and wake up when
        it ends."""
        scheduler = replica.scheduler
        scheduled = scheduler.schedule()
        lazy = isinstance(scheduler, LazyDecodeScheduler)
        quiet = scheduler.quiet_steps() if lazy else 0
        if not scheduled and not quiet:
            replica.busy = False
            return
        replica.busy = True
        replica.scheduled = scheduled
        if quiet:
            replica.window = _Window(now, quiet, scheduler.parked, scheduler.parked_context(), replica.cost)
            replica.step_end = now + replica.window.duration(quiet)
        else:
            prefill = sum(
                r.num_scheduled_tokens for r in scheduled if r.num_computed_tokens < r.num_prompt_tokens
            )
            decode = sum(1 for r in scheduled if r.num_computed_tokens >= r.num_prompt_tokens)
            context = sum(r.num_computed_tokens + r.num_scheduled_tokens for r in scheduled)
            if lazy:
                decode, context = decode + scheduler.parked, context + scheduler.parked_context()
            # the copies between the tiers this step's scheduling asked for run before it
            copies = len(replica.bm.drain_transfers()) * self.restore_block_s
            replica.step_end = now + copies + replica.cost.step_seconds(prefill, decode, context)
        self._wake(replica, replica.step_end)

    def _split_window(self, replica: SimReplica, now: float) -> None:
        """An arrival for a replica mid-window: stop the window at the next step boundary."""
        w = replica.window
        done = 1
        while done < w.steps and w.start + w.duration(done) < now:
            done += 1
        if done < w.steps:
            w.steps = done
            replica.step_end = w.start + w.duration(done)
            self._wake(replica, replica.step_end)

    def _finish_iteration(self, replica: SimReplica, now: float) -> None:
        scheduled, replica.scheduled = replica.scheduled, []
        if replica.window is not None:  # quiet steps: only parked decoders ran
            replica.scheduler.skip(replica.window.steps)
            replica.steps += replica.window.steps
            replica.window = None
        else:
            replica.steps += 1
            for r in scheduled:
                if r.num_computed_tokens < r.num_prompt_tokens:
                    replica.prefill_tokens += r.num_scheduled_tokens
            replica.scheduler.step_done(scheduled)
        for r in scheduled:
            if r.num_computed_tokens < len(r):
                continue  # a prefill chunk that did not reach the end of the prompt
            self._emit_token(replica, self._active[id(r)], now)
        events = replica.bm.drain_events()
        if not self.event_lag_s:
            self.index.apply(replica.index, events)
        elif events:
            self._lagged.append((now + self.event_lag_s, replica.index, events))
        self._plan(replica, now)
        self._queues_changed(replica)

    def _emit_token(self, replica: SimReplica, record: SimRequest, now: float) -> None:
        """The token sampled at the end of this iteration; finishes the request at max_tokens."""
        r = record.request
        r.append_token(record.sampled(1)[0])
        if record.first_token_s is None:
            record.first_token_s = now
            self._prefill_done(record)
        if r.num_completion_tokens >= r.params.max_tokens:
            replica.scheduler.finish(r, "length")
            self._end(record)
            self.results.add(record, now)
            del self._active[id(r)]

    # ------------------------------------------------------------------ results

    def summary(self) -> dict:
        loads = [rep.prefill_tokens for rep in self.replicas]
        counts = [0] * len(self.replicas)
        for r in self.results["replica"]:
            counts[r] += 1
        mean_load = statistics.mean(loads) if loads else 0.0
        return {
            **request_stats([self.results]),
            "rejected": self.rejected,
            "load_imbalance_max_over_mean": round(max(loads) / mean_load, 3) if mean_load else 0.0,
            "load_cv": round(statistics.pstdev(loads) / mean_load, 3) if mean_load else 0.0,
            "requests_max_over_mean": round(max(counts) / statistics.mean(counts), 3) if sum(counts) else 0.0,
            "cold_share_max_over_fair": round(self.cold.worst(), 3),
            "share_alarms": self.share_alarms,
            "preemptions": sum(rep.scheduler.num_preemptions for rep in self.replicas),
        }


def request_stats(runs: Sequence[Results]) -> dict:
    """What the finished requests of one or several simulations (a mix of models) saw."""
    arrival = [a for c in runs for a in c["arrival_s"]]
    first = [f for c in runs for f in c["first_token_s"]]
    done = [d for c in runs for d in c["done_s"]]
    completion = [n for c in runs for n in c["completion_tokens"]]
    ttft = [f - a for f, a in zip(first, arrival, strict=True)]
    prompt = sum(sum(c["prompt_tokens"]) for c in runs)
    cached = sum(sum(c["cached_tokens"]) for c in runs)
    host = sum(sum(c["host_cached_tokens"]) for c in runs)
    predicted = sum(sum(c["predicted_tokens"]) for c in runs)
    span = max(done, default=0.0) - min(arrival, default=0.0)
    tpot = [(d - f) / (n - 1) for d, f, n in zip(done, first, completion, strict=True) if n > 1]
    return {
        "num_requests": len(done),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "predicted_hit_rate": round(predicted / prompt, 4) if prompt else 0.0,
        "host_hit_rate": round(host / prompt, 4) if prompt else 0.0,  # of hit_rate, restored from host tiers
        "ttft_p50": round(percentile(ttft, 0.5), 4),
        "ttft_p90": round(percentile(ttft, 0.9), 4),
        "ttft_p99": round(percentile(ttft, 0.99), 4),
        "tpot_p50": round(percentile(tpot, 0.5), 5) if tpot else None,
        "throughput_tok_s": round(sum(completion) / span, 1) if span > 0 else 0.0,
        "simulated_s": round(span, 2),
    }
