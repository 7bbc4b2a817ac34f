"""How far a router trusts the index, per replica and overall: EXACT, DEGRADED or LOAD_ONLY.

Each replica keeps a sliding window of its last requests' outcomes (exact, or a miss cause
from ``predictions.py``). Only the causes that say the index is wrong count against it
(``stale_index``, ``hash_mismatch``); evictions, lag and unrealized speculation are
normal. The state follows the window:

- EXACT: lies below ``degraded_rate`` of the window (or none left in it);
- DEGRADED: at or above it: the router asks the replica to resync (rate-limited across
  routers by the caller) and keeps using the index for it;
- LOAD_ONLY: lies at or above ``load_only_rate``, or any hash mismatch: the router stops
  using the index for that replica (it routes there by load alone) until the window clears.

A new incarnation of a replica starts with an empty window. Overall: LOAD_ONLY when the
index cannot be read or every replica is LOAD_ONLY, DEGRADED when any replica is not
EXACT, EXACT otherwise.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from kvmesh.router.index_trust.predictions import LIES
from kvmesh.serving.options import option

EXACT, DEGRADED, LOAD_ONLY = "EXACT", "DEGRADED", "LOAD_ONLY"
STATES = (EXACT, DEGRADED, LOAD_ONLY)


@dataclass(frozen=True)
class IndexTrustConfig:
    window: int = option(
        20,
        flag="index-trust-window",
        former="index-health-window",
        help="requests per replica the index trust is judged on",
    )
    max_age_s: float = option(
        60.0,
        flag="index-trust-max-age",
        former="index-health-window-s",
        help="seconds an outcome stays in that window",
    )
    min_samples: int = option(
        4,
        flag="index-trust-min-samples",
        former="index-health-min-samples",
        help="outcomes needed before a state changes",
    )
    degraded_rate: float = option(
        0.25,
        flag="index-degraded-rate",
        help="share of index lies that makes a replica DEGRADED (and resync)",
    )
    load_only_rate: float = option(
        0.6,
        flag="index-load-only-rate",
        help="share of index lies that makes the router ignore the index for it",
    )
    lag_tolerance_s: float = option(
        2.0,
        flag="index-lag-tolerance",
        help="seconds an index may lag a replica's cache before it counts as stale",
    )
    resync_interval_s: float = option(
        30.0,
        flag="index-resync-interval",
        help="least seconds between resyncs of one replica, across routers",
    )

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.max_age_s <= 0 or self.lag_tolerance_s < 0:
            raise ValueError("index trust: window, min_samples and max_age_s must be positive")
        if not 0 < self.degraded_rate <= self.load_only_rate <= 1:
            raise ValueError("index trust: need 0 < degraded_rate <= load_only_rate <= 1")


@dataclass
class ReplicaTrust:
    config: IndexTrustConfig
    incarnation: int = 0
    state: str = EXACT
    cause: str = ""  # the lie behind a state other than EXACT
    outcomes: collections.deque = field(default_factory=collections.deque)  # (time, cause or None)

    def record(self, cause: str | None, incarnation: int, now: float | None = None) -> tuple[str, str] | None:
        """One request's outcome; returns (new state, cause) when the state changed."""
        now = time.monotonic() if now is None else now
        before = (self.state, self.cause)
        if incarnation != self.incarnation:
            self.restarted(incarnation)
        self.outcomes.append((now, cause))
        self._evaluate(now)
        return (self.state, self.cause) if (self.state, self.cause) != before else None

    def restarted(self, incarnation: int) -> None:
        """A new incarnation: its cache and its index entries start fresh."""
        self.incarnation = incarnation
        self.outcomes.clear()
        self.state, self.cause = EXACT, ""

    def _evaluate(self, now: float) -> None:
        c = self.config
        while self.outcomes and (len(self.outcomes) > c.window or now - self.outcomes[0][0] > c.max_age_s):
            self.outcomes.popleft()
        lies = collections.Counter(cause for _, cause in self.outcomes if cause in LIES)
        state, cause = EXACT, ""
        if lies["hash_mismatch"]:
            state, cause = LOAD_ONLY, "hash_mismatch"
        elif lies and len(self.outcomes) < c.min_samples:
            state, cause = self.state, self.cause  # too few outcomes to change anything but a clear window
        elif lies:
            rate = sum(lies.values()) / len(self.outcomes)
            cause = lies.most_common(1)[0][0]
            state = LOAD_ONLY if rate >= c.load_only_rate else DEGRADED if rate >= c.degraded_rate else EXACT
        self.state, self.cause = state, "" if state == EXACT else cause


def overall_state(states: list[str], index_reachable: bool) -> str:
    if not index_reachable or (states and all(s == LOAD_ONLY for s in states)):
        return LOAD_ONLY
    return EXACT if all(s == EXACT for s in states) else DEGRADED
