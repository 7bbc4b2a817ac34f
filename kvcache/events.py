"""KV events: the stream of changes to the set of block hashes a new request could hit.

Each stored or removed event names its tier (``medium``, vLLM's convention): ``DEVICE`` (the
engine's KV pool) or ``HOST`` (its host-memory tier). Replaying every event from the start
of a BlockManager's life (``replay``) gives exactly its ``cached_hashes()``, and replaying
the host tier's its host pool's. Replicas ship these to the shared prefix index.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

DEVICE = "device"
HOST = "host"
MEDIA = (DEVICE, HOST)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """``hashes`` (a chain, in order) became resolvable; ``parent_hash`` precedes the first;
    ``root`` is the chain's first hash (the index places a chain's blocks by it)."""

    hashes: tuple[int, ...]
    parent_hash: int | None
    block_size: int
    root: int
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """``hashes`` stopped being resolvable (their last holder was overwritten); ``roots[i]``
    is the root of ``hashes[i]``'s chain."""

    hashes: tuple[int, ...]
    roots: tuple[int, ...]
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every hash stopped being resolvable, in every tier (cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class CachedBlocks:
    """A cache's hittable blocks per tier, each hash with its chain's root: the state its
    events describe, what a resync publishes."""

    device: dict[int, int]
    host: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.device) + len(self.host)


def replay(events: Iterable[KVEvent], into: set[int] | None = None, medium: str = DEVICE) -> set[int]:
    """Apply ``events`` of ``medium`` in order to a hash set (a new one unless ``into`` is given)."""
    hashes = set() if into is None else into
    for event in events:
        if isinstance(event, BlockStored):
            if event.medium == medium:
                hashes.update(event.hashes)
        elif isinstance(event, BlockRemoved):
            if event.medium == medium:
                hashes.difference_update(event.hashes)
        elif isinstance(event, AllBlocksCleared):
            hashes.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")
    return hashes
