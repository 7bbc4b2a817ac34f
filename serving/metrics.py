"""What the router's and the replicas' Prometheus metrics share: one registry per server (so
tests can run several in one process), latency buckets, and the exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # seconds


class ServerMetrics:
    """Base of a server's metrics: subclasses register theirs on ``self.registry``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def render(self) -> bytes:
        return generate_latest(self.registry)
