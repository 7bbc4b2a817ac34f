"""What the shared prefix index answers, split by concern, and the types its answers carry.

Two implementations keep this contract: ``RedisPrefixIndex`` (``kvmesh.kvcache.index.redis``: one
Redis/Valkey server or a cluster, shared by every process of a deployment) and
``MemoryPrefixIndex`` (``kvmesh.kvcache.index.memory``: one process; the simulator and unit
tests get index answers from it without a server). Callers type against ``PrefixIndex``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.kvcache.events import DEVICE, KVEvent

DEFAULT_DEPLOYMENT = "default"
# A speculative entry: (replica id, root = the first hash of the chain, hashes of that chain).
Speculation = tuple[str, int, Sequence[int]]
LOAD_FIELDS = {"n": "requests", "p": "prefill_blocks", "d": "decode_blocks"}


class IndexSettingsError(RuntimeError):
    """This process's model id / block size / hash seed differ from the cluster's."""


@dataclass(frozen=True)
class ReplicaRecord:
    replica_id: str
    address: str
    incarnation: int
    heartbeat_ttl_ms: int  # time left before the replica stops counting as live
    fields: Mapping[str, str]  # everything else in its record (load, start time, ...)
    slot: int = 0  # its column in the block entries (stable while its record lives)

    def load(self, name: str, default: float = 0.0) -> float:
        """A numeric field, ``default`` when missing or not a finite number: a record is what
        a process wrote into a shared server, so a routing decision never trusts it to parse."""
        try:
            value = float(self.fields.get(name, ""))
        except ValueError:
            return default
        return value if math.isfinite(value) else default


@dataclass(frozen=True)
class FleetWork:
    """What every live router has in flight on one replica (``reserve``)."""

    requests: float = 0.0
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0


@dataclass(frozen=True)
class IndexView:
    """What one ``routing_view`` call returns (blocks per replica, work per replica)."""

    matched: dict[str, int]  # leading blocks each replica published in its device tier
    speculative: dict[str, int]  # leading blocks routers just sent it (not published yet)
    fleet: dict[str, FleetWork] | None  # None: not asked (this router does not share its load)
    # leading blocks each replica holds on its device or host tier (>= matched: host blocks
    # continue a device prefix, or start one where the device holds none)
    tiered: dict[str, int] = dataclasses.field(default_factory=dict)


def own_settings(
    model_id: str, deployment: str, block_size: int | None, hash_seed: int | None
) -> dict[str, str]:
    """The settings a process stores (or must find) in the index: every process of a
    deployment hashes blocks alike only if these agree."""
    if block_size is None or hash_seed is None:
        raise ValueError("this index client has no settings to store (block size 'auto')")
    return {
        "model_id": model_id,
        "deployment": deployment,
        "block_size": str(block_size),
        "hash_seed": str(hash_seed),
    }


def check_settings(mine: Mapping[str, str], stored: Mapping[str, str]) -> None:
    """IndexSettingsError naming each setting ``stored`` (the index's, authoritative) has
    otherwise than ``mine``."""
    wrong = {k: (stored.get(k), v) for k, v in mine.items() if stored.get(k) != v}
    if wrong:
        detail = ", ".join(
            f"{k}: the index has {have!r:.80}, this process {want!r}" for k, (have, want) in wrong.items()
        )
        raise IndexSettingsError(f"prefix index settings differ ({detail})")


def load_field(replica_id: str, kind: str) -> str:
    return f"{replica_id}|{kind}"


def fleet_work(fields: Mapping[str, float]) -> dict[str, FleetWork]:
    """``load_field`` -> amount, as work per replica (negative dust read as zero)."""
    work: dict[str, dict[str, float]] = {}
    for field, value in fields.items():
        replica_id, _, kind = field.rpartition("|")
        if kind in LOAD_FIELDS:
            work.setdefault(replica_id, {})[LOAD_FIELDS[kind]] = max(0.0, float(value))
    return {rid: FleetWork(**w) for rid, w in work.items()}


class BlockIndex(Protocol):
    """Which replica holds which blocks: what replicas publish, what lookups read."""

    async def publish(self, replica_id: str, incarnation: int, events: Iterable[KVEvent]) -> bool:
        """Apply Stored/Removed events in order; False: that incarnation is no longer live."""

    async def publish_all(
        self, replica_id: str, incarnation: int, blocks: Mapping[int, int], host: Mapping[int, int] = {}
    ) -> bool:
        """Publish a whole cache (``hash -> root``, the chain's first hash; ``host``: its host
        tier's), a resync."""

    async def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of the chain each live replica published (holders of none left out)."""

    async def sweep(self) -> int:
        """One step of background cleanup of dead entries; returns how many went."""

    async def snapshot(self, medium: str = DEVICE) -> dict[str, set[int]]:
        """Every live replica's hashes in one tier (O(index); for tests and debugging)."""


class Membership(Protocol):
    """Which replicas are live, under which incarnation, with what settings and load."""

    model_id: str
    deployment: str
    block_size: int | None
    hash_seed: int | None

    async def ensure_settings(self) -> None: ...

    async def settings(self) -> dict[str, str] | None: ...

    async def has_settings(self) -> bool: ...

    async def register(
        self, replica_id: str, address: str, ttl_s: float, info: Mapping[str, object] = ()
    ) -> int: ...

    async def heartbeat(
        self, replica_id: str, incarnation: int, ttl_s: float, load: Mapping[str, object] = ()
    ) -> bool: ...

    async def deregister(self, replica_id: str, incarnation: int) -> bool: ...

    async def retire(self, replica_id: str) -> bool: ...

    async def live_replicas(self) -> list[ReplicaRecord]: ...

    async def set_controller_state(self, state: str) -> None: ...

    async def controller_state(self) -> str | None: ...

    async def claim_resync(self, replica_id: str, interval_s: float) -> bool: ...


class RouterLedger(Protocol):
    """What routers share: their in-flight work per replica and their speculative entries."""

    async def register_router(self, ttl_s: float) -> int: ...

    async def router_heartbeat(self, router_incarnation: int, ttl_s: float) -> int:
        """Extend its life and reap dead routers' reservations; returns how many routers
        are registered (itself included), 0 when it had expired (register anew)."""
        ...

    async def deregister_router(self, router_incarnation: int) -> None: ...

    async def reserve(self, router_incarnation: int, deltas: Mapping[str, float]) -> bool: ...

    async def speculate(self, router_incarnation: int, entries: Iterable[Speculation], ttl_s: float) -> bool:
        """Every router's ``routing_view`` sees these blocks held by those replicas for ``ttl_s``."""

    async def share(
        self,
        router_incarnation: int,
        deltas: Mapping[str, float],
        entries: Iterable[Speculation],
        ttl_s: float,
    ) -> bool:
        """``reserve`` and ``speculate`` at once; False: the router expired."""

    async def routing_view(self, block_hashes: Sequence[int]) -> IndexView:
        """Everything a routing decision reads: matches, speculative matches, the fleet's work."""


class ShareHalves(ABC):
    """``reserve`` and ``speculate`` as the two halves of an implementation's ``share``."""

    @abstractmethod
    async def share(
        self,
        router_incarnation: int,
        deltas: Mapping[str, float],
        entries: Iterable[Speculation],
        ttl_s: float,
    ) -> bool:
        """``reserve`` and ``speculate`` at once; False: the router expired."""

    async def reserve(self, router_incarnation: int, deltas: Mapping[str, float]) -> bool:
        """Add ``deltas`` (``load_field(replica, "n"|"p"|"d")`` -> amount) to the fleet's and
        this router's in-flight work; False (nothing applied) if the router expired."""
        return await self.share(router_incarnation, deltas, (), 0.0)

    async def speculate(self, router_incarnation: int, entries: Iterable[Speculation], ttl_s: float) -> bool:
        """Record that this router sent each replica a prompt with these blocks (of the chain
        starting at root: a speculative match, like a replica's, runs from the first block);
        every router's ``routing_view`` sees them for ``ttl_s`` (Redis: to twice that, in time
        buckets). False: the router expired."""
        return await self.share(router_incarnation, {}, entries, ttl_s)


class PrefixIndex(BlockIndex, Membership, RouterLedger, Protocol):
    """The whole index as one deployment of one model sees it."""

    async def close(self) -> None: ...
