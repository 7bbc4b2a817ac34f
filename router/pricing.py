"""What the router prices each replica's work at: its measured step costs, bounded and smoothed
so that no fit can tip the fleet.

A replica's fit is noisy (a busy machine, a burst of odd step shapes); the policy multiplies a
price difference into where every cold prompt goes, so a fit that came out 25% low for a few
seconds used to draw every cold prompt (the issue-49 pile-up). Here a price moves only
continuously and only as far as hardware can explain:

- **One factor per replica.** Every replica is priced at the fleet's median costs (each term's
  median over the measured replicas) times one factor: how its own fit compares to that median
  on a reference step, raised to its confidence (``steps / (steps + CONFIDENT_STEPS)``: a new
  fit counts little, a long one nearly fully).
- **Like hardware prices alike.** Replicas that report the same ``hardware`` label read
  factors within ``spread`` of their group's median factor (1.0: exactly alike; their differences
  then show in their queues, which the policy reads, not in their prices). Between different
  hardware the ratio is bounded by ``MAX_HARDWARE_RATIO`` only (never trust a record to be
  sane).
- **Smoothed, and only by fresh steps.** The factor a decision reads follows the target with a
  ``half_life_s`` time constant, and only while the fit saw new steps since the last update: an
  idle replica's stale fit neither moves its price nor gains weight.

Pure (time comes in as an argument), so the router's registry and the simulator price alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.serving.step_costs import PRIOR, StepCosts, median_costs

# The step a factor compares fits on: prompt tokens, decoding sequences, context tokens.
REFERENCE_STEP = (512, 16, 16_384)
# Steps after which a fit is trusted half (its fit's own half-life is 500 steps).
CONFIDENT_STEPS = 250.0
# No two replicas' prices differ by more than this, whatever they report.
MAX_HARDWARE_RATIO = 20.0


@dataclass(frozen=True)
class MeasuredReplica:
    """What a replica's record says of its costs, as pricing reads it."""

    replica_id: str
    hardware: str  # its device class ("cpu", a GPU's name): like hardware prices alike
    costs: StepCosts | None  # its fit, once measured (``measured_costs``), else None
    steps: float  # steps that fit has seen (cumulative)


@dataclass
class _Track:
    log_factor: float = 0.0  # the smoothed factor a decision reads, as a log
    steps: float = 0.0  # the fit's step count at the last update
    at: float | None = None  # when it was last updated


class FleetPrices:
    """Turns the live replicas' fits into what the policy prices each one at."""

    def __init__(self, spread: float = 1.0, half_life_s: float = 10.0):
        if spread < 1.0:
            raise ValueError(f"spread must be >= 1 (1: like hardware prices alike), got {spread}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.spread = spread
        self.half_life_s = half_life_s
        self.median: StepCosts = PRIOR
        self._tracks: dict[str, _Track] = {}
        self._factors: dict[str, float] = {}  # what each replica's price is the median's times

    def update(self, replicas: Iterable[MeasuredReplica], now: float) -> dict[str, StepCosts]:
        """Each live replica's price now; replicas not listed are forgotten."""
        replicas = list(replicas)
        self.median = median_costs([r.costs for r in replicas if r.costs is not None])
        reference = max(self.median.step_seconds(*REFERENCE_STEP), 1e-12)
        self._tracks = {
            r.replica_id: self._follow(r, _weighted_log_ratio(r, reference), now) for r in replicas
        }
        # Clamped after smoothing: replicas of one group whose fits saw fresh steps at
        # different moments still read prices within the spread (at 1: exactly one price).
        bound, reach = math.log(MAX_HARDWARE_RATIO), math.log(self.spread)
        self._factors = {}
        for group in _by_hardware(replicas).values():
            center = statistics.median(self._tracks[r.replica_id].log_factor for r in group)
            for r in group:
                own = min(max(self._tracks[r.replica_id].log_factor, center - reach), center + reach)
                self._factors[r.replica_id] = math.exp(min(max(own, -bound), bound))
        return {rid: self.priced(rid) for rid in self._tracks}

    def priced(self, replica_id: str) -> StepCosts:
        """The price of a replica seen at the last update (the median if it was not)."""
        factor = self._factors.get(replica_id, 1.0)
        return StepCosts(*(term * factor for term in self.median.terms()))

    def _follow(self, replica: MeasuredReplica, target: float, now: float) -> _Track:
        track = self._tracks.get(replica.replica_id)
        if track is None or track.at is None:  # first seen: start at its target
            return _Track(target, replica.steps, now)
        if replica.steps > track.steps:  # fresh steps: move toward the target
            keep = 0.5 ** (max(0.0, now - track.at) / self.half_life_s)
            track.log_factor = keep * track.log_factor + (1 - keep) * target
            track.steps = replica.steps
        track.at = now
        return track


def _weighted_log_ratio(replica: MeasuredReplica, reference: float) -> float:
    """log(its fit's reference step / the median's), times its confidence (0 unmeasured)."""
    if replica.costs is None:
        return 0.0
    ratio = max(replica.costs.step_seconds(*REFERENCE_STEP), 1e-12) / reference
    confidence = replica.steps / (replica.steps + CONFIDENT_STEPS)
    return confidence * math.log(ratio)


def _by_hardware(replicas: list[MeasuredReplica]) -> dict[str, list[MeasuredReplica]]:
    groups: dict[str, list[MeasuredReplica]] = {}
    for r in replicas:
        groups.setdefault(r.hardware, []).append(r)
    return groups
