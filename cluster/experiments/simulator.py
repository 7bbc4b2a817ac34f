"""Discrete-event simulation of a kvmesh cluster, for 100s of replicas.

What is real here, not modelled: each replica's ``BlockManager`` and ``Scheduler`` (the
engine's own classes: continuous batching, chunked prefill, prefix reuse, preemption by
recompute), the hash contract, the routing policy classes, the speculative overlay and the
router's in-flight accounting. What is modelled: time (``CostModel`` per engine iteration)
and the index (updated from the ledgers' KV events the moment an iteration ends).

Speed: a replica whose batch is only decoding, with nobody waiting, runs many identical
iterations as one "window" (closed-form duration) up to the first finish or block boundary;
an arrival routed to it mid-window splits the window at the next iteration boundary.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.cluster.experiments.cost_model import CostModel
from kvmesh.cluster.experiments.workloads import WorkloadRequest
from kvmesh.cluster.stats import percentile
from kvmesh.kvcache import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    block_hashes,
    namespace_seed,
)
from kvmesh.replica.request import Request
from kvmesh.replica.scheduler import Scheduler
from kvmesh.router.load import ReplicaLoad, RequestWork
from kvmesh.router.policies import Policy, ReplicaState, RouteRequest, make_policy
from kvmesh.router.speculative import SpeculativeOverlay
from kvmesh.serving.sampling import SamplingParams


@dataclass
class SimRequest:
    index: int
    spec: WorkloadRequest
    request: Request
    hashes: list[int]
    replica: int
    work: RequestWork
    predicted_tokens: int
    answer: list[int]
    first_token_s: float | None = None
    done_s: float | None = None


class SimIndex:
    """hash -> replicas holding it, fed by the ledgers' KV events (the Redis index's role)."""

    def __init__(self) -> None:
        self.holders: dict[int, set[int]] = defaultdict(set)

    def apply(self, replica: int, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                for h in e.hashes:
                    self.holders[h].add(replica)
            elif isinstance(e, BlockRemoved):
                for h in e.hashes:
                    holders = self.holders.get(h)
                    if holders is not None:
                        holders.discard(replica)
                        if not holders:
                            del self.holders[h]
            elif isinstance(e, AllBlocksCleared):
                for h in [h for h, r in self.holders.items() if replica in r]:
                    self.holders[h].discard(replica)

    def lookup(self, hashes: Sequence[int]) -> dict[int, int]:
        """Leading blocks each replica holds consecutively (what ``kvmesh_lookup`` returns)."""
        if not hashes or hashes[0] not in self.holders:
            return {}
        cand = set(self.holders[hashes[0]])
        depth = dict.fromkeys(cand, 1)
        for i in range(1, len(hashes)):
            cand &= self.holders.get(hashes[i], set())
            if not cand:
                break
            for r in cand:
                depth[r] = i + 1
        return depth


@dataclass
class _Window:
    """k identical decode iterations in flight, started at ``start``."""

    start: float
    steps: int
    batch: int
    context: int  # context tokens of the batch at the first step

    def duration(self, cost: CostModel, steps: int) -> float:
        per = cost.base_s + cost.decode_seq_s * self.batch
        return steps * per + cost.context_token_s * (
            steps * self.context + self.batch * steps * (steps - 1) / 2
        )


@dataclass
class SimReplica:
    index: int
    bm: BlockManager
    scheduler: Scheduler
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    busy: bool = False
    version: int = 0  # invalidates stale wake-ups
    scheduled: list = field(default_factory=list)
    window: _Window | None = None
    step_end: float = 0.0
    prefill_tokens: int = 0  # uncached prompt tokens computed here (load balance metric)


class Simulation:
    def __init__(
        self,
        workload: Sequence[WorkloadRequest],
        replicas: int,
        policy: str | Policy,
        cost: CostModel,
        block_size: int = 256,
        blocks_per_replica: int | None = None,
        speculative_ttl_s: float = 2.0,
        seed: int = 0,
        progress: Callable[[int], object] | None = None,  # called with 1 per arrival
        decode_windows: bool = True,
    ):
        if replicas <= 0:
            raise ValueError("replicas must be positive")
        self.workload = sorted(workload, key=lambda r: r.arrival_s)
        self.cost = cost
        self.block_size = block_size
        self.policy = (
            make_policy(policy, block_size=block_size, seed=seed) if isinstance(policy, str) else policy
        )
        self.seed_hash = namespace_seed("simulated-model", block_size)
        num_blocks = blocks_per_replica or max(1, cost.kv_tokens_per_replica // block_size)
        self.replicas = []
        for i in range(replicas):
            bm = BlockManager(num_blocks, block_size, seed=self.seed_hash)
            self.replicas.append(
                SimReplica(i, bm, Scheduler(bm, cost.max_num_seqs, cost.max_num_batched_tokens))
            )
        self._states = [ReplicaState(str(i), num_blocks=num_blocks) for i in range(replicas)]
        self.index = SimIndex()
        self.overlay = SpeculativeOverlay(ttl_s=speculative_ttl_s)
        self.done: list[SimRequest] = []
        self.rejected = 0
        self._events: list[tuple[float, int, int, int]] = []  # (time, tiebreak, replica, version)
        self._tiebreak = 0
        self._active: dict[int, SimRequest] = {}  # id(Request) -> record
        self._progress = progress
        self.decode_windows = decode_windows

    # ------------------------------------------------------------------ main loop

    def run(self) -> dict:
        i, n = 0, len(self.workload)
        while i < n or self._events:
            next_arrival = self.workload[i].arrival_s if i < n else math.inf
            if self._events and self._events[0][0] < next_arrival:
                t, _, r, version = heapq.heappop(self._events)
                replica = self.replicas[r]
                if version == replica.version:
                    self._finish_iteration(replica, t)
                continue
            self._arrive(i, self.workload[i], next_arrival)
            i += 1
        return self.summary()

    def _wake(self, replica: SimReplica, at: float) -> None:
        replica.version += 1
        self._tiebreak += 1
        heapq.heappush(self._events, (at, self._tiebreak, replica.index, replica.version))

    # ------------------------------------------------------------------ routing

    def _arrive(self, i: int, spec: WorkloadRequest, now: float) -> None:
        tokens = spec.tokens()
        if -(-(len(tokens) + spec.max_tokens) // self.block_size) > self.replicas[0].bm.num_blocks:
            self.rejected += 1
            return
        hashes = block_hashes(tokens, self.block_size, self.seed_hash)
        matched = self.index.lookup(hashes)
        for rid, depth in self.overlay.matched(hashes, now).items():
            if depth > matched.get(int(rid), 0):
                matched[int(rid)] = depth
        for rep, state in zip(self.replicas, self._states, strict=True):
            state.matched_blocks = matched.get(rep.index, 0)
            state.inflight_requests = rep.load.requests
            state.inflight_prefill_blocks = rep.load.prefill_blocks
            state.inflight_decode_blocks = rep.load.decode_blocks
            state.recent_blocks = rep.load.recent.value(now)
            state.num_running = len(rep.scheduler.running)
            state.num_waiting = len(rep.scheduler.waiting)
        route = RouteRequest(tokens, hashes, spec.max_tokens, spec.session)
        chosen = int(self.policy.rank(route, self._states)[0])
        replica = self.replicas[chosen]
        self.overlay.record(str(chosen), hashes, now)
        depth = matched.get(chosen, 0)
        work = RequestWork.estimate(len(hashes), depth, spec.max_tokens, self.block_size)
        replica.load.begin(work, now)
        params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True)
        request = Request(str(i), tokens, self.block_size, params, None, frozenset(), None)
        request.arrival_time = now
        lookable = (len(tokens) - 1) // self.block_size
        answer = spec.answer_tokens() or [(i + k) % 997 + 3 for k in range(spec.max_tokens)]
        record = SimRequest(
            i, spec, request, hashes, chosen, work, min(depth, lookable) * self.block_size, answer
        )
        self._active[id(request)] = record
        replica.scheduler.add(request)
        if replica.window is not None:
            self._split_window(replica, now)
        elif not replica.busy:
            self._plan(replica, now)
        if self._progress:
            self._progress(1)

    # ------------------------------------------------------------------ replica iterations

    def _plan(self, replica: SimReplica, now: float) -> None:
        """Schedule the next iteration (or decode window) and wake up when it ends."""
        scheduled = replica.scheduler.schedule()
        if not scheduled:
            replica.busy = False
            return
        replica.busy = True
        replica.scheduled = scheduled
        window = self._window_steps(replica, scheduled)
        if window > 1:
            context = sum(r.num_computed_tokens + 1 for r in scheduled)
            replica.window = _Window(now, window, len(scheduled), context)
            replica.step_end = now + replica.window.duration(self.cost, window)
        else:
            prefill = sum(
                r.num_scheduled_tokens for r in scheduled if r.num_computed_tokens < r.num_prompt_tokens
            )
            decode = sum(1 for r in scheduled if r.num_computed_tokens >= r.num_prompt_tokens)
            context = sum(r.num_computed_tokens + r.num_scheduled_tokens for r in scheduled)
            replica.step_end = now + self.cost.step_seconds(prefill, decode, context)
        self._wake(replica, replica.step_end)

    def _window_steps(self, replica: SimReplica, scheduled: list[Request]) -> int:
        """How many identical decode iterations can run as one (1 = not a pure decode batch)."""
        s = replica.scheduler
        if not self.decode_windows or s.waiting or len(scheduled) != len(s.running):
            return 1
        steps = math.inf
        bs = self.block_size
        for r in scheduled:
            if r.num_scheduled_tokens != 1 or r.num_computed_tokens < r.num_prompt_tokens:
                return 1
            room = len(r.block_table) * bs - r.num_computed_tokens  # positions with a block already
            left = r.params.max_tokens - r.num_completion_tokens  # tokens until it finishes
            steps = min(steps, room, left)
        return int(steps)

    def _split_window(self, replica: SimReplica, now: float) -> None:
        """An arrival for a replica mid-window: stop the window at the next iteration boundary."""
        w = replica.window
        done = 1
        while done < w.steps and w.start + w.duration(self.cost, done) < now:
            done += 1
        if done < w.steps:
            w.steps = done
            replica.step_end = w.start + w.duration(self.cost, done)
            self._wake(replica, replica.step_end)

    def _finish_iteration(self, replica: SimReplica, now: float) -> None:
        scheduled, replica.scheduled = replica.scheduled, []
        steps = replica.window.steps if replica.window else 1
        replica.window = None
        for r in scheduled:
            if r.num_computed_tokens < r.num_prompt_tokens:
                replica.prefill_tokens += r.num_scheduled_tokens
        replica.scheduler.step_done(scheduled)
        for r in scheduled:
            if r.num_computed_tokens < len(r):
                continue  # a prefill chunk that did not reach the end of the prompt
            record = self._active[id(r)]
            if steps > 1:  # steps 2..k each computed the token the previous step appended
                k = r.num_completion_tokens
                r.token_ids.extend(record.answer[k : k + steps - 1])
                r.token_ids.extend([3] * (k + steps - 1 - max(k, len(record.answer))))  # past the answer
                r.num_computed_tokens += steps - 1
                replica.bm.hash_blocks(r)
            self._emit_token(replica, record, now)
        self.index.apply(replica.index, replica.bm.drain_events())
        self._plan(replica, now)

    @staticmethod
    def _append(record: SimRequest) -> None:
        k = record.request.num_completion_tokens
        record.request.append_token(record.answer[k] if k < len(record.answer) else 3)

    def _emit_token(self, replica: SimReplica, record: SimRequest, now: float) -> None:
        """The token sampled at the end of this iteration; finishes the request at max_tokens."""
        r = record.request
        self._append(record)
        if record.first_token_s is None:
            record.first_token_s = now
            replica.load.prefill_done(record.work)
        if r.num_completion_tokens >= r.params.max_tokens:
            replica.scheduler.finish(r, "length")
            record.done_s = now
            replica.load.end(record.work)
            self.done.append(record)
            del self._active[id(r)]

    # ------------------------------------------------------------------ results

    def summary(self) -> dict:
        recs = self.done
        ttft = [r.first_token_s - r.request.arrival_time for r in recs]
        prompt = sum(r.request.num_prompt_tokens for r in recs)
        cached = sum(r.request.cached_prompt_tokens or 0 for r in recs)
        predicted = sum(r.predicted_tokens for r in recs)
        out_tokens = sum(r.request.num_completion_tokens for r in recs)
        span = max((r.done_s for r in recs), default=0.0) - min(
            (r.request.arrival_time for r in recs), default=0.0
        )
        loads = [rep.prefill_tokens for rep in self.replicas]
        counts = [sum(1 for r in recs if r.replica == rep.index) for rep in self.replicas]
        mean_load = statistics.mean(loads) if loads else 0.0
        tpot = [
            (r.done_s - r.first_token_s) / (r.request.num_completion_tokens - 1)
            for r in recs
            if r.request.num_completion_tokens > 1
        ]
        return {
            "num_requests": len(recs),
            "rejected": self.rejected,
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "predicted_hit_rate": round(predicted / prompt, 4) if prompt else 0.0,
            "ttft_p50": round(percentile(ttft, 0.5), 4),
            "ttft_p90": round(percentile(ttft, 0.9), 4),
            "ttft_p99": round(percentile(ttft, 0.99), 4),
            "tpot_p50": round(percentile(tpot, 0.5), 5) if tpot else None,
            "throughput_tok_s": round(out_tokens / span, 1) if span > 0 else 0.0,
            "load_imbalance_max_over_mean": round(max(loads) / mean_load, 3) if mean_load else 0.0,
            "load_cv": round(statistics.pstdev(loads) / mean_load, 3) if mean_load else 0.0,
            "requests_max_over_mean": round(max(counts) / statistics.mean(counts), 3)
            if counts and sum(counts)
            else 0.0,
            "preemptions": sum(rep.scheduler.num_preemptions for rep in self.replicas),
            "simulated_s": round(span, 2),
        }
