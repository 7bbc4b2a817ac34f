"""Speculative entries: "replica R will hold these blocks", recorded at routing time.

A replica publishes a prompt's blocks only after computing them, so without this a burst
of requests sharing a new prefix would scatter before the first one's events arrive. Each
entry lives ``ttl_s`` seconds (long enough for the real events to land); the overlay is
bounded and forgets its oldest entries first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.kvcache.index.memory import leading_matches


class SpeculativeOverlay:
    def __init__(self, ttl_s: float = 2.0, max_entries: int = 200_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._expiry: OrderedDict[tuple[str, int], float] = OrderedDict()  # oldest first
        self._holders: dict[int, set[str]] = {}  # hash -> replicas with a live entry

    def record(self, replica_id: str, block_hashes: Sequence[int], now: float | None = None) -> None:
        expiry = (time.monotonic() if now is None else now) + self.ttl_s
        for h in block_hashes:
            key = (replica_id, h)
            self._expiry.pop(key, None)
            self._expiry[key] = expiry
            self._holders.setdefault(h, set()).add(replica_id)
        while len(self._expiry) > self.max_entries:
            self._drop(*self._expiry.popitem(last=False)[0])

    def matched(self, block_hashes: Sequence[int], now: float | None = None) -> dict[str, int]:
        """Leading blocks of the chain each replica is expected to hold (only those with any)."""
        self._expire(time.monotonic() if now is None else now)
        return leading_matches(self._holders, block_hashes)

    def _expire(self, now: float) -> None:
        while self._expiry:
            key, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                break
            del self._expiry[key]
            self._drop(*key)

    def _drop(self, replica_id: str, h: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._holders[h]

    def __len__(self) -> int:
        return len(self._expiry)
