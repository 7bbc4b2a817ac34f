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


class SpeculativeOverlay:
    def __init__(self, ttl_s: float = 2.0, max_entries: int = 200_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], float] = OrderedDict()  # (replica, hash) -> expiry

    def record(self, replica_id: str, block_hashes: Sequence[int], now: float | None = None) -> None:
        expiry = (time.monotonic() if now is None else now) + self.ttl_s
        for h in block_hashes:
            key = (replica_id, h)
            self._entries.pop(key, None)
            self._entries[key] = expiry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def matched(self, replica_id: str, block_hashes: Sequence[int], now: float | None = None) -> int:
        """Leading blocks of the chain this replica is expected to hold."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        depth = 0
        for h in block_hashes:
            expiry = self._entries.get((replica_id, h))
            if expiry is None or expiry <= now:
                break
            depth += 1
        return depth

    def _expire(self, now: float) -> None:
        while self._entries:
            key, expiry = next(iter(self._entries.items()))
            if expiry > now:
                break
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
