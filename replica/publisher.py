"""Keeps the shared prefix index equal to this replica's cache, whatever Redis does.

- Registers a new incarnation and publishes the whole cache (a *sync*) at start, and
  again whenever the index may have diverged: a publish or heartbeat failed, Redis lost
  the incarnation (expired, restarted), the local buffer overflowed, or the cache was reset.
- In between, publishes the engine's KV events in order, in one call per batch (a batch is
  whatever the engine produced since the last publish, usually one step).
- Heartbeats its load with a TTL, sweeps stale entries a little at a time, and
  deregisters on a graceful stop, or while its engine cannot serve (``withdraw``: routers
  stop choosing it at their next refresh; ``rejoin`` syncs it back).
The engine never waits for any of this: when Redis is away the replica keeps serving and
is only marked dirty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import ResponseError

from kvmesh.engine.protocol import ServingEngine
from kvmesh.kvcache import AllBlocksCleared, KVEvent
from kvmesh.kvcache.index.api import IndexSettingsError, PrefixIndex
from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.serving.background import BackgroundLoops, sleep_to_next_tick

log = logging.getLogger(__name__)


class IndexPublisher:
    def __init__(
        self,
        index: PrefixIndex,
        engine: ServingEngine,
        replica_id: str,
        address: str,
        info: dict[str, object] | None = None,
        heartbeat_s: float = 1.0,
        ttl_s: float = 3.0,
        max_buffered_events: int = 100_000,
        retry_s: float = 0.5,
        sweep_s: float = 5.0,
    ):
        self.index = index
        self.engine = engine
        self.replica_id = replica_id
        self.address = address
        self.info = info or {}
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.max_buffered_events = max_buffered_events
        self.retry_s, self.sweep_s = retry_s, sweep_s
        self.incarnation: int | None = None
        self.dirty = True  # the index may not equal the cache: sync before publishing
        self.withdrawn: str | None = None  # why this replica is out of the index on purpose
        self.refusal: Exception | None = None  # why the index refused its last sync (None: it did not)
        self.refused_since: float | None = None  # monotonic time it began refusing
        self.syncs = 0
        self.synced_hashes = 0  # hashes the last sync published
        self._buffer: list[KVEvent] = []
        self._last_sync_attempt = 0.0
        self._loops = BackgroundLoops()
        self._tokens_at = (time.monotonic(), 0)

    async def start(self) -> None:
        """Try a first sync (Redis may be down: then it is retried), start the loops. A
        replica whose settings differ from the index's stored ones does not start
        (IndexSettingsError): it would publish hashes no router can match."""
        await self._try_sync()
        if isinstance(self.refusal, IndexSettingsError):
            raise self.refusal
        self._loops.start(self._events_loop, "kvmesh-publish")
        self._loops.start(self._heartbeat_loop, "kvmesh-heartbeat")
        self._loops.start(self._sweep_loop, "kvmesh-sweep")

    async def stop(self) -> None:
        await self._loops.stop()
        if self.incarnation is not None:
            with contextlib.suppress(*INDEX_ERRORS):
                await self.index.deregister(self.replica_id, self.incarnation)
        self.incarnation = None

    async def withdraw(self, reason: str) -> None:
        """Leave the index and stay out (the engine cannot serve) until ``rejoin``."""
        if self.withdrawn is None:
            log.error("replica leaves the index: its engine cannot serve", extra={"reason": reason})
        self.withdrawn, self.dirty = reason, True
        incarnation, self.incarnation = self.incarnation, None
        if incarnation is not None:
            with contextlib.suppress(*INDEX_ERRORS):
                await self.index.deregister(self.replica_id, incarnation)

    def rejoin(self) -> None:
        """Serve again: the events loop registers a new incarnation with the whole cache."""
        if self.withdrawn is not None:
            log.warning("replica rejoins the index", extra={"was": self.withdrawn})
        self.withdrawn, self._last_sync_attempt = None, 0.0

    # ------------------------------------------------------------------ sync

    async def _try_sync(self) -> None:
        self._last_sync_attempt = time.monotonic()
        try:
            await self._sync()
        except (IndexSettingsError, ResponseError) as exc:  # the index answered: not this way
            self._refuse(exc)
        except INDEX_ERRORS as exc:
            log.warning("prefix index unreachable, serving without it", extra={"error": str(exc)})
            self.dirty = True
        else:
            self.refusal, self.refused_since = None, None

    @property
    def refused(self) -> str | None:
        """Why the index refused this replica's last sync, as its health says (None: it did not)."""
        return None if self.refusal is None else str(self.refusal)

    def _refuse(self, exc: Exception) -> None:
        """The index refused this replica's sync (settings that differ, a register it did not
        take): it stays out, and tries again every ``retry_s`` (the settings may be restored)."""
        if self.refused != str(exc):
            log.error("the prefix index refused this replica; retrying", extra={"reason": str(exc)[:300]})
        if self.refused_since is None:
            self.refused_since = time.monotonic()
        self.refusal, self.dirty = exc, True

    def out_of_index_for(self) -> float:
        """Seconds the index has refused this replica without a break (0 while it is in, or
        only unreachable: a Redis outage is not the replica's fault)."""
        return 0.0 if self.refused_since is None else time.monotonic() - self.refused_since

    async def _sync(self) -> None:
        await self.index.ensure_settings()
        blocks = await self.engine.snapshot_cached_blocks()  # later events are relative to it
        self._buffer.clear()
        incarnation = await self.index.register(self.replica_id, self.address, self.ttl_s, self._record())
        if self.withdrawn is not None:  # the engine failed while this sync was on its way
            await self.index.deregister(self.replica_id, incarnation)
            return
        self.incarnation = incarnation
        if await self.index.publish_all(self.replica_id, incarnation, blocks.device, host=blocks.host):
            self.dirty = False
            self.syncs += 1
            self.synced_hashes = len(blocks)
            log.info("prefix index synced", extra={"incarnation": incarnation, "hashes": len(blocks)})

    async def resync(self, reason: str, timeout_s: float = 10.0) -> int:
        """Publish the whole cache again under a new incarnation (a router saw the index lie
        about this replica); returns the hashes published. TimeoutError if Redis is away."""
        syncs = self.syncs
        self.sync_soon(f"asked to resync: {reason}")
        async with asyncio.timeout(timeout_s):
            while self.syncs == syncs:
                await asyncio.sleep(0.01)
        return self.synced_hashes

    def sync_soon(self, why: str) -> None:
        """Sync again at the events loop's next turn, not after ``retry_s``."""
        self._mark_dirty(why)
        self._last_sync_attempt = 0.0

    def _mark_dirty(self, why: str) -> None:
        if not self.dirty:
            log.warning("prefix index out of sync, will resync", extra={"reason": why})
        self.dirty = True

    # ------------------------------------------------------------------ loops

    async def _events_loop(self) -> None:
        while self._loops.running:
            # The engine thread wakes this as soon as a step leaves events; the timeout only
            # paces resync attempts. (It was 5 ms while in sync: an idle replica's loop woke
            # 200 times a second, ~24 ms of CPU a second for nothing.)
            await self.engine.wait_kv_events(self.retry_s)
            self._buffer.extend(self.engine.drain_kv_events())
            if len(self._buffer) > self.max_buffered_events:
                self._buffer.clear()
                self._mark_dirty("event buffer overflow")
            if any(isinstance(e, AllBlocksCleared) for e in self._buffer):
                self._buffer.clear()
                self._mark_dirty("cache reset")
            if self.withdrawn is not None:
                self._buffer.clear()  # a rejoin publishes the whole cache
                continue
            if self.dirty:
                if time.monotonic() - self._last_sync_attempt >= self.retry_s:
                    await self._try_sync()
                continue
            if self._buffer:
                await self._publish_buffer()

    async def _publish_buffer(self) -> None:
        batch, self._buffer = self._buffer, []
        try:
            if not await self.index.publish(self.replica_id, self.incarnation, batch):
                self._mark_dirty("incarnation retired")
        except INDEX_ERRORS as exc:
            self._mark_dirty(f"publish failed: {exc}")

    async def _heartbeat_loop(self) -> None:
        while self._loops.running:
            await sleep_to_next_tick(self.heartbeat_s)
            if self.dirty or self.incarnation is None:
                continue
            try:
                if not await self.index.heartbeat(
                    self.replica_id, self.incarnation, self.ttl_s, self._load()
                ):
                    self._mark_dirty("heartbeat refused: incarnation expired")
            except INDEX_ERRORS as exc:
                self._mark_dirty(f"heartbeat failed: {exc}")

    async def _sweep_loop(self) -> None:
        while self._loops.running:
            await sleep_to_next_tick(self.sweep_s)
            if not self.dirty:
                with contextlib.suppress(*INDEX_ERRORS):
                    await self.index.sweep()

    # ------------------------------------------------------------------ records

    def _record(self) -> dict[str, object]:
        return {**self.info, **self._load()}

    def _load(self) -> dict[str, object]:
        """What its heartbeat says of its load and costs (with a host tier: what restoring
        a block from it costs, once measured)."""
        stats = self.engine.stats()
        restore = stats.host.restore_block_s if stats.host else None
        now = time.monotonic()
        then, tokens = self._tokens_at
        rate = (stats.generation_tokens - tokens) / (now - then) if now > then else 0.0
        self._tokens_at = (now, stats.generation_tokens)
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_blocks": stats.kv.num_blocks,
            "num_free_blocks": stats.kv.num_free_blocks,
            "num_cached_free_blocks": stats.kv.num_cached_free_blocks,
            "tokens_per_s": round(rate, 1),
            "prefix_hit_rate": round(stats.kv.prefix_hit_rate, 4),
            **stats.step_costs.as_fields(),
            "cost_steps": stats.step_cost_samples,
            **({} if restore is None else {"cost_restore_block_s": f"{restore:.4g}"}),
            "cost_restore_blocks": stats.host.restored_blocks if stats.host else 0,
            "num_host_blocks": stats.host.num_blocks if stats.host else 0,
            "num_host_used_blocks": stats.host.num_used_blocks if stats.host else 0,
        }
