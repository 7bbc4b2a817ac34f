"""The one percentile every report and benchmark uses, so "p99" means the same in every JSON file.

Linear interpolation between the closest ranks (numpy's default, Hyndman-Fan type 7): p50 is
the median, and small samples do not jump between neighbouring values.
"""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``values``; NaN when there are none."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latency_ms(seconds: Sequence[float], digits: int = 3) -> dict[str, float]:
    """p50, p90 and p99 of latencies in seconds, as milliseconds."""
    return {
        "p50_ms": round(percentile(seconds, 0.5) * 1e3, digits),
        "p90_ms": round(percentile(seconds, 0.9) * 1e3, digits),
        "p99_ms": round(percentile(seconds, 0.99) * 1e3, digits),
    }
