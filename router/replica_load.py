"""Load accounting: what the requests a router sent each replica still owe it, in blocks.

The router and the simulator both keep one ``ReplicaLoad`` per replica, so the policies see
load the same way in both. Prefill work is paid off at a request's first token, decode work
when it ends; ``recent`` (the new prefixes placed there lately, decaying) breaks ties between
otherwise equal replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class DecayingSum:
    """A sum whose past contributions halve every ``half_life_s`` (recent work per replica)."""

    def __init__(self, half_life_s: float = 60.0):
        self.half_life_s = half_life_s
        self._value = 0.0
        self._at = 0.0

    def value(self, now: float) -> float:
        return self._value * 0.5 ** ((now - self._at) / self.half_life_s) if self._value else 0.0

    def order_key(self) -> float:
        """A number that orders sums by their value at any one moment (they all halve at the
        same rate, so the order never changes between additions): log2 of the value,
        carried to a common time origin."""
        return math.log2(self._value) + self._at / self.half_life_s if self._value > 0 else -math.inf

    def add(self, amount: float, now: float) -> None:
        self._value = self.value(now) + amount
        self._at = now


@dataclass
class RequestWork:
    """What one routed request still owes a replica, in blocks: its uncached prefill (paid
    off at its first token) and its decode (paid off when it ends). ``new_prefix``: the
    replica held none of its blocks (a new prefix placed there)."""

    prefill: float
    decode: float
    new_prefix: bool = False

    @classmethod
    def estimate(cls, num_blocks: int, matched_blocks: int, max_tokens: int, block_size: int) -> RequestWork:
        uncached = num_blocks - min(matched_blocks, num_blocks)
        return cls(uncached, max_tokens / block_size, uncached == num_blocks)


class ReplicaLoad:
    """A router's own accounting of the work it sent one replica (the router and the
    simulator both keep one per replica, so they see load the same way).

    ``recent`` counts new prefixes only, not every uncached block: the tie-break spreads
    prompts nobody holds, and a prefix's later requests follow it wherever it went. Counting
    those requests' uncached parts too made a replica that served hot prefixes lately owe
    the others their whole load, and a burst of new prefixes then all went to the one that
    served least (measured with one long-lived router, rounds of 8 new shared prefixes on 4
    replicas: a round uneven in 3 of 10 real runs and 79 of 200 simulated rounds, 4 of the 8
    on one replica at worst; now 2 of 10 and 22 of 200, 3 of 8 at worst;
    docs/policy-experiments.md, "New prefixes after a busy minute")."""

    def __init__(self, half_life_s: float = 60.0):
        self.requests = 0
        self.prefill_blocks = 0.0
        self.decode_blocks = 0.0
        self.recent = DecayingSum(half_life_s)

    def begin(self, work: RequestWork, now: float) -> None:
        self.requests += 1
        self.prefill_blocks += work.prefill
        self.decode_blocks += work.decode
        self.recent.add(work.prefill if work.new_prefix else 0.0, now)

    def prefill_done(self, work: RequestWork) -> None:
        self.prefill_blocks -= work.prefill
        work.prefill = 0.0

    def end(self, work: RequestWork) -> None:
        self.requests -= 1
        self.prefill_blocks -= work.prefill
        self.decode_blocks -= work.decode
