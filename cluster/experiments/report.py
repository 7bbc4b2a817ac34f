"""Summaries of load-generator records: hit rate, latency percentiles, throughput, balance."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence

from kvmesh.cluster.experiments.loadgen import RequestRecord


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(records: Sequence[RequestRecord]) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    predicted = sum(r.predicted_cached_tokens for r in ok)
    span = max((r.done_s for r in ok), default=0.0) - min((r.sent_s for r in ok), default=0.0)
    per_replica = collections.Counter(r.replica_id for r in ok)
    counts = list(per_replica.values())
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "predicted_hit_rate": round(predicted / prompt, 4) if prompt else 0.0,
        "index_accuracy": round(1 - abs(predicted - cached) / max(cached, predicted, 1), 4),
        "ttft_p50_ms": round(percentile(ttft, 0.5) * 1e3, 1),
        "ttft_p90_ms": round(percentile(ttft, 0.9) * 1e3, 1),
        "ttft_p99_ms": round(percentile(ttft, 0.99) * 1e3, 1),
        "output_tokens_per_s": round(sum(r.completion_tokens for r in ok) / span, 1) if span > 0 else 0.0,
        "requests_per_replica": dict(sorted(per_replica.items())),
        "load_imbalance_max_over_mean": round(max(counts) / statistics.mean(counts), 3) if counts else 0.0,
    }
