"""The prefix index in one process's memory: the same contract as the Redis one
(``api.PrefixIndex``), for the simulator and for tests that need index answers, not a
server. Time comes from ``clock`` (seconds), so a simulation or a test can run it on its own.

Entries of a replica that re-registers, deregisters, is retired or misses its heartbeat
leave at once (the Redis index lets them lie until a sweep, but never counts them either).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TypeVar

from kvmesh.kvcache.events import DEVICE, HOST, MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.kvcache.index.api import (
    DEFAULT_DEPLOYMENT,
    IndexView,
    ReplicaRecord,
    ShareHalves,
    Speculation,
    check_settings,
    fleet_work,
    own_settings,
)

T = TypeVar("T")


def leading_matches(holders: Mapping[int, AbstractSet[T]], block_hashes: Sequence[int]) -> dict[T, int]:
    """How many leading blocks of a hash chain each holder has, consecutively from the first
    (holders of none left out): what the index's lookup answers, over sets in memory."""
    if not block_hashes or block_hashes[0] not in holders:
        return {}
    candidates = set(holders[block_hashes[0]])
    depth = dict.fromkeys(candidates, 1)
    for i in range(1, len(block_hashes)):
        candidates &= holders.get(block_hashes[i], frozenset())
        if not candidates:
            break
        for holder in candidates:
            depth[holder] = i + 1
    return depth


@dataclass
class _Replica:
    incarnation: int
    address: str
    expires_at: float
    slot: int
    fields: dict[str, str] = field(default_factory=dict)


class MemoryPrefixIndex(ShareHalves):
    """One deployment of one model's index in this process."""

    def __init__(
        self,
        model_id: str = "memory",
        block_size: int | None = None,
        hash_seed: int | None = None,
        deployment: str = DEFAULT_DEPLOYMENT,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.model_id, self.deployment = model_id, deployment
        self.block_size, self.hash_seed = block_size, hash_seed
        self.clock = clock
        self._settings: dict[str, str] | None = None
        self._next = itertools.count(1)
        self._replicas: dict[Hashable, _Replica] = {}
        # per tier: hash -> live replicas holding it, and replica -> hashes it holds
        self.holders: dict[str, dict[int, set[Hashable]]] = {m: {} for m in MEDIA}
        self._held: dict[str, dict[Hashable, set[int]]] = {m: {} for m in MEDIA}
        self._speculated: dict[int, dict[str, float]] = {}  # hash -> replica -> until when
        self._routers: dict[int, float] = {}  # router incarnation -> expires at
        self._load: Counter[str] = Counter()
        self._shares: dict[int, Counter[str]] = {}
        self._controller: str | None = None
        self._resync_claims: dict[str, float] = {}

    async def close(self) -> None:
        """Nothing to release."""

    # ------------------------------------------------------------------ blocks (also sync)

    def apply(self, replica_id: Hashable, events: Iterable[KVEvent]) -> None:
        """Apply a replica's KV events in order (the simulator calls this directly)."""
        for event in events:
            if isinstance(event, BlockStored):
                self._add(replica_id, event.hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                held = self._held[event.medium].get(replica_id, set())
                held.difference_update(event.hashes)
                for h in event.hashes:
                    self._drop(h, replica_id, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self._forget_blocks(replica_id)
            else:
                raise TypeError(f"not a KV event: {event!r}")

    def matches(self, block_hashes: Sequence[int]) -> dict[Hashable, int]:
        """Leading blocks of the chain each replica holds in its device tier (the simulator
        calls this directly)."""
        return leading_matches(self.holders[DEVICE], block_hashes)

    def tiered_matches(self, block_hashes: Sequence[int]) -> dict[Hashable, int]:
        """Leading blocks of the chain each replica holds in its device or host tier."""
        device, host = self.holders[DEVICE], self.holders[HOST]
        either = {h: device.get(h, set()) | host.get(h, set()) for h in block_hashes}
        return leading_matches(either, block_hashes)

    def _add(self, replica_id: Hashable, hashes: Iterable[int], medium: str) -> None:
        hashes = list(hashes)
        self._held[medium].setdefault(replica_id, set()).update(hashes)
        holders = self.holders[medium]
        for h in hashes:
            holders.setdefault(h, set()).add(replica_id)

    def _drop(self, h: int, replica_id: Hashable, medium: str) -> None:
        holders = self.holders[medium].get(h)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self.holders[medium][h]

    def _forget_blocks(self, replica_id: Hashable) -> None:
        for medium in MEDIA:
            for h in self._held[medium].pop(replica_id, ()):
                self._drop(h, replica_id, medium)

    async def publish(self, replica_id: str, incarnation: int, events: Iterable[KVEvent]) -> bool:
        if not self._is_live(replica_id, incarnation):
            return False
        self.apply(replica_id, events)
        return True

    async def publish_all(
        self, replica_id: str, incarnation: int, blocks: Mapping[int, int], host: Mapping[int, int] = {}
    ) -> bool:
        if not self._is_live(replica_id, incarnation):
            return False
        self._add(replica_id, blocks, DEVICE)
        self._add(replica_id, host, HOST)
        return True

    async def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        self._expire()
        return self.matches(block_hashes)

    async def sweep(self) -> int:
        """Drops expired speculation (dead replicas' entries already left)."""
        now, removed = self.clock(), 0
        for h in list(self._speculated):
            entries = self._speculated[h]
            for rid in [rid for rid, until in entries.items() if until <= now]:
                del entries[rid]
                removed += 1
            if not entries:
                del self._speculated[h]
        return removed

    async def snapshot(self, medium: str = DEVICE) -> dict[str, set[int]]:
        self._expire()
        return {rid: set(self._held[medium].get(rid, ())) for rid in self._replicas}

    # ------------------------------------------------------------------ membership

    async def ensure_settings(self) -> None:
        mine = own_settings(self.model_id, self.deployment, self.block_size, self.hash_seed)
        if self._settings is None:
            self._settings = mine
        check_settings(mine, self._settings)

    async def settings(self) -> dict[str, str] | None:
        return dict(self._settings) if self._settings else None

    async def has_settings(self) -> bool:
        return self._settings is not None

    async def register(
        self, replica_id: str, address: str, ttl_s: float, info: Mapping[str, object] = ()
    ) -> int:
        self._forget_blocks(replica_id)
        old = self._replicas.get(replica_id)
        slot = old.slot if old else min(set(range(len(self._replicas) + 1)) - self._slots())
        fields = {k: str(v) for k, v in dict(info).items()}
        replica = _Replica(next(self._next), address, self.clock() + ttl_s, slot, fields)
        self._replicas[replica_id] = replica
        return replica.incarnation

    def _slots(self) -> set[int]:
        return {r.slot for r in self._replicas.values()}

    async def heartbeat(
        self, replica_id: str, incarnation: int, ttl_s: float, load: Mapping[str, object] = ()
    ) -> bool:
        if not self._is_live(replica_id, incarnation):
            return False
        replica = self._replicas[replica_id]
        replica.expires_at = self.clock() + ttl_s
        replica.fields.update({k: str(v) for k, v in dict(load).items()})
        return True

    async def deregister(self, replica_id: str, incarnation: int) -> bool:
        if not self._is_live(replica_id, incarnation):
            return False
        self._forget(replica_id)
        return True

    async def retire(self, replica_id: str) -> bool:
        replica = self._replicas.get(replica_id)
        if replica is None or replica.expires_at <= self.clock():
            return False
        replica.expires_at = -float("inf")
        self._forget_blocks(replica_id)
        return True

    async def live_replicas(self) -> list[ReplicaRecord]:
        self._expire()
        now = self.clock()
        return [
            ReplicaRecord(
                rid, r.address, r.incarnation, int((r.expires_at - now) * 1000), dict(r.fields), r.slot
            )
            for rid, r in self._replicas.items()
            if r.expires_at > now
        ]

    def _is_live(self, replica_id: str, incarnation: int) -> bool:
        replica = self._replicas.get(replica_id)
        return (
            replica is not None and replica.incarnation == incarnation and replica.expires_at > self.clock()
        )

    def _forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)
        self._forget_blocks(replica_id)

    def _expire(self) -> None:
        now = self.clock()
        for rid, replica in self._replicas.items():
            if replica.expires_at <= now:
                self._forget_blocks(rid)

    async def set_controller_state(self, state: str) -> None:
        self._controller = state

    async def controller_state(self) -> str | None:
        return self._controller

    async def claim_resync(self, replica_id: str, interval_s: float) -> bool:
        now = self.clock()
        if self._resync_claims.get(replica_id, -float("inf")) > now:
            return False
        self._resync_claims[replica_id] = now + interval_s
        return True

    # ------------------------------------------------------------------ routers

    async def register_router(self, ttl_s: float) -> int:
        incarnation = next(self._next)
        self._routers[incarnation] = self.clock() + ttl_s
        self._shares[incarnation] = Counter()
        return incarnation

    async def router_heartbeat(self, router_incarnation: int, ttl_s: float) -> int:
        alive = self._router_live(router_incarnation)
        if alive:
            self._routers[router_incarnation] = self.clock() + ttl_s
        self._reap()
        return len(self._routers) if alive else 0

    async def deregister_router(self, router_incarnation: int) -> None:
        self._routers.pop(router_incarnation, None)
        self._reap()

    def _router_live(self, router_incarnation: int) -> bool:
        return self._routers.get(router_incarnation, -float("inf")) > self.clock()

    def _reap(self) -> None:
        for rinc in [r for r in self._shares if not self._router_live(r)]:
            self._load.subtract(self._shares.pop(rinc))
            self._routers.pop(rinc, None)
        self._load = Counter({k: v for k, v in self._load.items() if abs(v) > 1e-6})

    async def share(
        self,
        router_incarnation: int,
        deltas: Mapping[str, float],
        entries: Iterable[Speculation],
        ttl_s: float,
    ) -> bool:
        if not self._router_live(router_incarnation):
            return False
        self._load.update(deltas)
        self._shares[router_incarnation].update(deltas)
        until = self.clock() + ttl_s
        for replica_id, _root, hashes in entries:
            for h in hashes:
                self._speculated.setdefault(h, {})[replica_id] = until
        return True

    async def routing_view(self, block_hashes: Sequence[int]) -> IndexView:
        self._expire()
        now = self.clock()
        live = {rid for rid, r in self._replicas.items() if r.expires_at > now}
        speculated = {
            h: {rid for rid, until in self._speculated.get(h, {}).items() if until > now and rid in live}
            for h in block_hashes
        }
        fleet = fleet_work({k: v for k, v in self._load.items() if abs(v) > 1e-6})
        return IndexView(
            self.matches(block_hashes),
            leading_matches(speculated, block_hashes),
            fleet,
            self.tiered_matches(block_hashes),
        )
