"""The share alarm: a replica that took far more than its fair share of one model's new
prefixes lately, made visible and kept from more of them until it is back under.

A policy that tips (a noisy price, a burst the guards missed) piles prompts nobody held on
one replica, whatever caused it: each router counts the new prefixes it placed on each
replica over a sliding window (requests the replica held none of: it computes them from
scratch), and a replica whose share of them, or of their prefill, is over ``factor`` times its
fair share (but never a line above halfway between fair and everything, so two replicas can
alarm too) turns the alarm on. Requests that found their prefix are not counted: a replica
holding a hot prefix takes many by design (the hot-spot guard bounds those), and counting them
turned the alarm on in skewed traces where nothing piled up (docs/design.md). While on, the prefix policy sends it no prompt it would compute from scratch
(``PrefixAware.held_back``); a prefix it alone holds still goes there. It turns off once the
share is under ``CLEAR_AT`` of the line (no flapping at the line). Memory: one count per
live replica per bucket.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.router.replica_load import RequestWork

# The alarm clears below this share of its line.
CLEAR_AT = 0.8


@dataclass
class _Bucket:
    start: float
    requests: dict[str, int] = field(default_factory=dict)
    prefill: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """The alarm turned on or off for a replica (for the log line and the metrics)."""

    replica_id: str
    on: bool
    request_share: float
    prefill_share: float
    fair_share: float


class ShareAlarm:
    def __init__(
        self, factor: float = 2.0, window_s: float = 60.0, min_per_replica: int = 5, buckets: int = 12
    ):
        if factor <= 1:
            raise ValueError(f"share alarm factor must be > 1, got {factor}")
        if window_s <= 0 or min_per_replica <= 0 or buckets <= 0:
            raise ValueError("share alarm window, minimum and buckets must be positive")
        self.factor = factor
        self.window_s = window_s
        self.min_per_replica = min_per_replica
        self._bucket_s = window_s / buckets
        self._buckets: deque[_Bucket] = deque()
        self.on: set[str] = set()  # replicas whose alarm is on

    def record(self, replica_id: str, work: RequestWork, now: float) -> None:
        """A request sent to ``replica_id``: counted if it is a new prefix there (and not empty)."""
        if not work.new_prefix or work.prefill <= 0:
            return
        if not self._buckets or now >= self._buckets[-1].start + self._bucket_s:
            self._buckets.append(_Bucket(now))
        bucket = self._buckets[-1]
        bucket.requests[replica_id] = bucket.requests.get(replica_id, 0) + 1
        bucket.prefill[replica_id] = bucket.prefill.get(replica_id, 0.0) + work.prefill

    def line(self, num_replicas: int) -> float:
        """The share over which a replica's alarm turns on."""
        fair = 1 / num_replicas
        return min(self.factor * fair, (1 + fair) / 2)

    def update(self, live: Iterable[str], now: float) -> list[Change]:
        """Re-judge every live replica over the window ending ``now``; the changes."""
        while self._buckets and self._buckets[0].start + self._bucket_s <= now - self.window_s:
            self._buckets.popleft()
        live = sorted(set(live))
        requests = {rid: sum(b.requests.get(rid, 0) for b in self._buckets) for rid in live}
        prefill = {rid: sum(b.prefill.get(rid, 0.0) for b in self._buckets) for rid in live}
        total_requests, total_prefill = sum(requests.values()), sum(prefill.values())
        changes = []
        line = self.line(len(live)) if live else 1.0
        for rid in live:
            request_share = requests[rid] / total_requests if total_requests else 0.0
            prefill_share = prefill[rid] / total_prefill if total_prefill else 0.0
            share = max(request_share, prefill_share)
            counted = total_requests >= self.min_per_replica * len(live) and len(live) > 1
            if rid not in self.on and counted and share > line:
                self.on.add(rid)
            elif rid in self.on and (not counted or share < CLEAR_AT * line):
                self.on.discard(rid)
            else:
                continue
            changes.append(Change(rid, rid in self.on, request_share, prefill_share, 1 / len(live)))
        for gone in self.on - set(live):
            self.on.discard(gone)
            changes.append(Change(gone, False, 0.0, 0.0, 1 / max(1, len(live))))
        return changes
