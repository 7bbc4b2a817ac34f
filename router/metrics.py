"""The router's Prometheus metrics (one registry per router, so tests can run several)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kvmesh.serving.metrics import LATENCY_BUCKETS, ServerMetrics

_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class RouterMetrics(ServerMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter(
            "kvmesh_router_requests", "Generate requests by outcome", ["policy", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "kvmesh_router_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "kvmesh_router_request_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.decisions = Counter(
            "kvmesh_router_routing_decisions", "Requests sent, by replica", ["replica"], registry=r
        )
        self.retries = Counter("kvmesh_router_failovers", "Requests retried on another replica", registry=r)
        self.predicted_cached = Counter(
            "kvmesh_router_predicted_cached_tokens",
            "Prompt tokens the router expected to be cached",
            registry=r,
        )
        self.actual_cached = Counter(
            "kvmesh_router_actual_cached_tokens", "Prompt tokens the replicas reported cached", registry=r
        )
        self.prompt_tokens = Counter("kvmesh_router_prompt_tokens", "Prompt tokens routed", registry=r)
        self.lookup = Histogram(
            "kvmesh_router_index_lookup_seconds",
            "Prefix index lookup latency",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "kvmesh_router_decision_seconds",
            "Routing decision: tokenize + hash + lookup + choose",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.index_errors = Counter(
            "kvmesh_router_index_errors", "Lookups that fell back to load only", registry=r
        )
