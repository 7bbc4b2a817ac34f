"""Load accounting: what the requests a router sent each replica still owe it, in blocks.

The router and the simulator both keep one ``ReplicaLoad`` per replica, so the policies see
load the same way in both. Prefill work is paid off at a request's first token, decode work
when it ends; ``recent`` decays, for tie-breaks between otherwise equal replicas.
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
    off at its first token) and its decode (paid off when it ends)."""

    prefill: float
    decode: float

    @classmethod
    def estimate(cls, num_blocks: int, matched_blocks: int, max_tokens: int, block_size: int) -> RequestWork:
        return cls(num_blocks - min(matched_blocks, num_blocks), max_tokens / block_size)


class ReplicaLoad:
    """A router's own accounting of the work it sent one replica (the router and the
    simulator both keep one per replica, so they see load the same way)."""

    def __init__(self, half_life_s: float = 60.0):
        self.requests = 0
        self.prefill_blocks = 0.0
        self.decode_blocks = 0.0
        self.recent = DecayingSum(half_life_s)

    def begin(self, work: RequestWork, now: float) -> None:
        self.requests += 1
        self.prefill_blocks += work.prefill
        self.decode_blocks += work.decode
        self.recent.add(work.prefill, now)

    def prefill_done(self, work: RequestWork) -> None:
        self.prefill_blocks -= work.prefill
        work.prefill = 0.0

    def end(self, work: RequestWork) -> None:
        self.requests -= 1
        self.prefill_blocks -= work.prefill
        self.decode_blocks -= work.decode
