"""This router's share of the fleet's in-flight work, kept in the index so every router's
policy sees what all routers sent each replica (``--shared-load``).

The router registers an incarnation with a heartbeat (like a replica) and reserves work
on a replica when it routes a request there: one request, its uncached prefill and its
decode, in blocks; the prefill is released at the first token, the rest at the end. The
reservations are sent after the decision, never waited for: deltas made in one event-loop
turn go out together in one call. Until that call lands, another router can miss them
(the race window: one loop turn plus one round trip; each batch's is observed in
``kvmesh_router_fleet_sync_seconds``); this router
adds its own unsent deltas to what the index returns. Speculative entries go the same way
("this replica will hold these blocks": the blocks of a prompt past what the index showed),
so every router sends the rest of a burst after its first request. A router that dies leaks nothing
past its heartbeat TTL: the next heartbeat of any router takes its reservations back.
When the index cannot be reached, the router routes on its own counts (the caller's
fallback) and, once the index is back, re-registers and re-reserves what it still has in
flight, so the fleet's totals never keep a stale share.

A router alone (its heartbeat counts the registered routers) sends nothing per request: no
other router would read it, and the decision reads its own counts. When its heartbeat sees
another router (within ``heartbeat_s`` of that router's start; until then the newcomer sees
this one's work as of when it was last shared), it re-registers holding exactly what it has
in flight and shares every request from then on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

from kvmesh.kvcache.index.api import FleetWork, PrefixIndex, load_field
from kvmesh.kvcache.index.redis import INDEX_ERRORS
from kvmesh.serving.background import BackgroundLoops, sleep_to_next_tick

log = logging.getLogger(__name__)
# The pseudo replica of the work a router is about to place (flow control's claims): never a
# replica's id, which readers accept only with 1 to 128 characters.
UNPLACED = ""


class FleetLoad:
    def __init__(
        self, index: PrefixIndex, heartbeat_s: float = 1.0, ttl_s: float = 5.0, speculative_ttl_s: float = 2.0
    ):
        self.index = index
        self.heartbeat_s, self.ttl_s = heartbeat_s, ttl_s
        self.speculative_ttl_s = speculative_ttl_s
        self._speculation: dict[tuple[str, int], list[int]] = {}  # (replica, root) -> blocks to announce
        self._announced: tuple[int, dict[str, set[int]]] = (-1, {})  # (bucket, replica -> blocks sent in it)
        self.incarnation: int | None = None  # None: not registered (yet, or lost): local counts only
        self._registering: int | None = None  # registered, not yet reserved and counted: stop() still owns it
        self.routers = 0  # routers registered as of the last heartbeat, this one included
        self._held: collections.Counter[str] = collections.Counter()  # field -> what this router holds
        self._unsent: collections.Counter[str] = collections.Counter()
        self._flush: asyncio.Task | None = None
        self._loops = BackgroundLoops()
        self._oldest_unsent: float | None = None  # when the oldest delta not yet in the index was made
        # Called with each batch's race window: from its oldest delta to the index applying it
        # (other routers miss the batch meanwhile); the router's metrics observe it.
        self.on_synced: Callable[[float], None] | None = None

    @property
    def active(self) -> bool:
        """Whether the fleet's totals include this router's work and other routers' (else
        route on local counts: the index is away, or this router is alone)."""
        return self.incarnation is not None and self.routers > 1

    @property
    def alone(self) -> bool:
        """Registered, and no other router is: nothing to share."""
        return self.incarnation is not None and self.routers <= 1

    async def start(self) -> None:
        await self._renew()
        self._loops.start(self._heartbeat_loop, "kvmesh-shared-load")

    async def stop(self) -> None:
        await self._loops.stop()
        if self._flush is not None:
            await asyncio.gather(self._flush, return_exceptions=True)
        incarnation = self.incarnation if self.incarnation is not None else self._registering
        if incarnation is not None:  # a renewal the stop cut short holds reservations too
            with contextlib.suppress(*INDEX_ERRORS):  # else its reservations expire with its heartbeat
                await self.index.deregister_router(incarnation)
        self.incarnation = self._registering = None

    # ------------------------------------------------------------------ reservations

    def add(self, replica_id: str, requests: float, prefill: float, decode: float) -> None:
        """Change this router's in-flight work on ``replica_id`` (sent within the loop turn)."""
        for kind, delta in (("n", requests), ("p", prefill), ("d", decode)):
            if delta:
                field = load_field(replica_id, kind)
                self._held[field] += delta
                if not self.alone:  # while registering too: what changed meanwhile goes after
                    self._unsent[field] += delta
        if self.active:
            self._schedule_send()

    def _schedule_send(self) -> None:
        if self._oldest_unsent is None:
            self._oldest_unsent = time.perf_counter()
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._send())

    def speculate(self, replica_id: str, block_hashes: list[int]) -> None:
        """Tell every router that ``replica_id`` will hold this chain (sent within the loop
        turn; blocks already announced for it in this time bucket of ``speculative_ttl_s``
        are not sent again). The index keeps an entry for one to two buckets of
        ``speculative_ttl_s`` on its own clock, so every router sees it about that long."""
        if not block_hashes or self.speculative_ttl_s <= 0 or not self.active:  # a TTL of 0: off
            return
        bucket = int(time.time() / self.speculative_ttl_s)
        if self._announced[0] != bucket:
            self._announced = (bucket, {})
        sent = self._announced[1].setdefault(replica_id, set())
        new = [h for h in block_hashes if h not in sent]
        if new:
            sent.update(new)
            self._speculation.setdefault((replica_id, block_hashes[0]), []).extend(new)
            self._schedule_send()

    def sent_requests(self, replica_id: str) -> float:
        """This router's requests on ``replica_id`` as the index has them."""
        field = load_field(replica_id, "n")
        return self._held[field] - self._unsent[field]

    def unsent(self, replica_id: str) -> FleetWork:
        """This router's deltas on ``replica_id`` not yet in the index (added to its totals)."""
        u = self._unsent
        return FleetWork(
            u[load_field(replica_id, "n")], u[load_field(replica_id, "p")], u[load_field(replica_id, "d")]
        )

    async def _send(self) -> None:
        """Send what accumulated, until nothing is left (deltas made while a call is in flight
        go out right after it)."""
        while self._unsent or self._speculation:
            await asyncio.sleep(0)  # let this loop turn's other deltas join
            speculation, self._speculation = self._speculation, {}
            if self.incarnation is None:
                return  # deltas kept: a new incarnation reserves everything held (speculation is dropped)
            deltas, self._unsent = dict(self._unsent), collections.Counter()
            since, self._oldest_unsent = self._oldest_unsent, None
            try:
                entries = [(rid, root, hashes) for (rid, root), hashes in speculation.items()]
                if not await self.index.share(self.incarnation, deltas, entries, self.speculative_ttl_s):
                    self.incarnation = None  # expired: its share was reaped; the heartbeat re-registers
                    return
                if self.on_synced is not None and since is not None:
                    self.on_synced(time.perf_counter() - since)
            except INDEX_ERRORS as exc:
                log.warning(
                    "shared load not sent, routing on this router's counts", extra={"error": str(exc)}
                )
                self.incarnation = None
                return

    # ------------------------------------------------------------------ liveness

    async def _heartbeat_loop(self) -> None:
        while self._loops.running:
            await sleep_to_next_tick(self.heartbeat_s)
            try:
                routers = 0
                if self.incarnation is not None:
                    routers = await self.index.router_heartbeat(self.incarnation, self.ttl_s)
                if not routers or (routers > 1 and self.routers <= 1):  # lost, or no longer alone
                    await self._renew()
                else:
                    self.routers = routers
            except INDEX_ERRORS:
                self.incarnation = None

    async def _renew(self) -> None:
        """A new incarnation holding exactly what this router has in flight now."""
        old, self.incarnation = self.incarnation, None
        try:
            if old is not None:
                await self.index.deregister_router(old)
            incarnation = self._registering = await self.index.register_router(self.ttl_s)
            held = {field: amount for field, amount in self._held.items() if abs(amount) > 1e-9}
            self._unsent, self._oldest_unsent = collections.Counter(), None  # all of it goes now
            if await self.index.reserve(incarnation, held):
                self.routers = await self.index.router_heartbeat(incarnation, self.ttl_s)
                self.incarnation, self._registering = incarnation, None
                log.info(
                    "sharing this router's in-flight work through the index",
                    extra={"incarnation": incarnation},
                )
                if self.alone:
                    self._unsent.clear()
                elif self._unsent:  # changed while registering
                    self._flush = asyncio.get_running_loop().create_task(self._send())
        except INDEX_ERRORS as exc:
            log.warning("shared load unavailable, routing on this router's counts", extra={"error": str(exc)})
