"""A replica's Prometheus metrics: request outcomes and latency recorded per request, engine
and KV cache state read from the engine's stats at scrape time (no polling thread)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.serving.metrics import LATENCY_BUCKETS, ServerMetrics

if TYPE_CHECKING:
    from kvmesh.replica.engine import EngineStats


class ReplicaMetrics(ServerMetrics):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter("kvmesh_replica_requests", "Requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram(
            "kvmesh_replica_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "kvmesh_replica_request_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.cached_tokens = Counter(
            "kvmesh_replica_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.finished_prompt_tokens = Counter(
            "kvmesh_replica_finished_prompt_tokens",
            "Prompt tokens of finished requests (the hit rate's denominator)",
            registry=r,
        )
        r.register(_EngineCollector(stats))


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        gauges = {
            "kvmesh_replica_running_requests": ("Requests being computed", s.num_running),
            "kvmesh_replica_waiting_requests": ("Requests queued for admission", s.num_waiting),
            "kvmesh_replica_kv_blocks": ("KV blocks in the pool", s.kv.num_blocks),
            "kvmesh_replica_kv_free_blocks": ("KV blocks free (cached or empty)", s.kv.num_free_blocks),
            "kvmesh_replica_kv_cached_free_blocks": (
                "Free KV blocks still hittable",
                s.kv.num_cached_free_blocks,
            ),
            "kvmesh_replica_kv_cached_hashes": (
                "Block hashes a new request could hit",
                s.kv.num_cached_hashes,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "kvmesh_replica_prompt_tokens": ("Prompt tokens admitted", s.prompt_tokens),
            "kvmesh_replica_generation_tokens": ("Tokens generated", s.generation_tokens),
            "kvmesh_replica_preemptions": ("Requests preempted for KV space", s.num_preemptions),
            "kvmesh_replica_prefix_query_tokens": ("Prompt tokens looked up in the prefix cache", s.kv.prefix_query_tokens),
            "kvmesh_replica_prefix_hit_tokens": ("Prompt tokens found in the prefix cache", s.kv.prefix_hit_tokens),
            "kvmesh_replica_kv_evictions": ("Cached blocks reused for new data", s.kv.evictions),
        }  # fmt: skip
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
