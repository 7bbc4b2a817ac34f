"""The router's watch that keeps its index trust: every prediction checked against the replica's
answer, each replica's trust state kept (``index_trust``), resyncs asked for, one log line
per change, metrics for the dashboard."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvmesh.kvcache.index.api import PrefixIndex
from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.protos import pb
from kvmesh.router.index_trust.predictions import Prediction, miss_cause
from kvmesh.router.index_trust.states import (
    EXACT,
    LOAD_ONLY,
    IndexTrustConfig,
    ReplicaTrust,
    overall_state,
)
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.registry import ReplicaRegistry

log = logging.getLogger(__name__)


class IndexWatch:
    def __init__(
        self,
        registry: ReplicaRegistry,
        index: PrefixIndex,
        metrics: RouterMetrics,
        block_size: int,
        config: IndexTrustConfig | None = None,
    ):
        self.registry = registry
        self.index = index
        self.metrics = metrics
        self.block_size = block_size
        self.config = config or IndexTrustConfig()
        self.trust: dict[str, ReplicaTrust] = {}
        self._tasks: set[asyncio.Task] = set()
        self._started: dict[str, str] = {}  # replica -> its process's start time (a restart changes it)
        self._overall = (EXACT, "")
        self._asked: dict[str, float] = {}  # replica -> when this router last asked it to resync
        registry.on_change(self._refreshed)

    def _of(self, replica_id: str) -> ReplicaTrust:
        if replica_id not in self.trust:
            self.trust[replica_id] = ReplicaTrust(self.config)
        return self.trust[replica_id]

    def state(self, replica_id: str) -> tuple[str, str]:
        h = self.trust.get(replica_id)
        return (h.state, h.cause) if h else (EXACT, "")

    def untrusted(self) -> set[str]:
        """Replicas whose index entries the router ignores (LOAD_ONLY)."""
        return {rid for rid, h in self.trust.items() if h.state == LOAD_ONLY}

    def overall(self) -> tuple[str, str]:
        """(state, cause) over the live replicas and the index itself."""
        if self.registry.index_problem:
            return LOAD_ONLY, self.registry.index_problem
        live = [self.state(e.record.replica_id) for e in self.registry.live()]
        state = overall_state([s for s, _ in live], True)
        cause = next((c for s, c in live if s != EXACT and c), "")
        return state, cause

    # ------------------------------------------------------------------ per request

    def observe(self, prediction: Prediction, complete: pb.Complete) -> str | None:
        """Check one request's prediction against the replica's answer; returns the miss cause."""
        cause = miss_cause(prediction, complete, self.block_size, self.config.lag_tolerance_s)
        self.metrics.prediction_error.observe(prediction.error(complete, self.block_size))
        if cause is not None:
            self.metrics.misses.labels(prediction.replica_id, cause).inc()
        incarnation = complete.incarnation or prediction.incarnation
        trust = self._of(prediction.replica_id)
        change = trust.record(cause, incarnation)
        if change is not None:
            self._changed(prediction.replica_id, *change)
        elif trust.state != EXACT:
            self._maybe_resync(prediction.replica_id, trust.cause)
        return cause

    def _changed(self, replica_id: str, state: str, cause: str) -> None:
        self.metrics.set_index_state(replica_id, state)
        self.metrics.state_changes.labels(replica_id, state, cause).inc()
        if state == EXACT:
            log.info("prefix index exact again for replica", extra={"replica_id": replica_id})
            return
        log.warning(
            "prefix index untrustworthy for replica",
            extra={"replica_id": replica_id, "state": state, "cause": cause},
        )
        self._maybe_resync(replica_id, cause)

    def _maybe_resync(self, replica_id: str, cause: str) -> None:
        """Ask a lying replica to resync, at most once per interval from this router (and,
        through the index's claim, from all routers); resync cannot fix hashing."""
        now = time.monotonic()
        if (
            cause == "hash_mismatch"
            or now - self._asked.get(replica_id, -1e9) < self.config.resync_interval_s
        ):
            return
        self._asked[replica_id] = now
        task = asyncio.create_task(self._resync(replica_id, cause))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resync(self, replica_id: str, cause: str) -> None:
        entry = self.registry.entries.get(replica_id)
        if entry is None:
            return
        try:
            if not await self.index.claim_resync(replica_id, self.config.resync_interval_s):
                return  # another router asked already
            await entry.stub.Resync(pb.ResyncRequest(reason=cause), timeout=30, metadata=entry.auth)
            self.metrics.resyncs.labels(replica_id).inc()
            log.info("asked the replica to resync its index entries", extra={"replica_id": replica_id})
        except (grpc.aio.AioRpcError, *INDEX_ERRORS) as exc:
            log.warning("resync request failed", extra={"replica_id": replica_id, "error": str(exc)})

    # ------------------------------------------------------------------ per refresh

    async def _refreshed(self, live: int) -> None:
        """After each registry refresh: a replica under a new incarnation (a restart, or a
        resync) starts a fresh window; departed replicas are forgotten; the overall state follows."""
        for rid, entry in self.registry.entries.items():
            record = entry.record
            h = self.trust.get(rid)
            if h is None or h.incarnation != record.incarnation:
                self._of(rid).restarted(record.incarnation)
                self.metrics.set_index_state(rid, EXACT)
            started = record.fields.get("process_started_at", "")
            if self._started.get(rid, started) != started:  # remembered across departures
                self.metrics.restarts.labels(rid).inc()
                log.info("replica restarted: its index entries start afresh", extra={"replica_id": rid})
            self._started[rid] = started
        for rid in set(self.trust) - set(self.registry.entries):
            del self.trust[rid]
            self.metrics.forget_replica(rid)
        overall = self.overall()
        if overall != self._overall:
            self._overall = overall
            self.metrics.set_overall_state(overall[0])
            level = logging.INFO if overall[0] == EXACT else logging.WARNING
            log.log(level, "prefix index state", extra={"state": overall[0], "cause": overall[1]})

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
