"""The router's Prometheus metrics (one registry per router, so tests can run several).

Requests, latency (vLLM's buckets), decisions by replica and by policy branch, the index's
lookup latency and errors, the prediction checks (fleet's best, predicted and actual cached
tokens, the per-request prediction error, misses by cause, resyncs, each replica's trust
state), share alarms turned on, and per-replica gauges read at scrape time from the
heartbeats and the share alarm (a replica that leaves is gone from the next scrape).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import GaugeMetricFamily

from kvmesh.router.index_trust.states import STATES
from kvmesh.router.share_alarm import Change
from kvmesh.serving.metrics import (
    FAST_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    MetricsRegistry,
    ServerMetrics,
)
from kvmesh.serving.model_info import ENGINE_KINDS

# Predicted minus reused blocks: 0 is exact, > 0 the index promised more than was there.
PREDICTION_ERROR_BUCKETS = (-64, -16, -4, -2, -1, -0.5, 0, 0.5, 1, 2, 4, 16, 64)


@dataclass(frozen=True)
class ReplicaGauges:
    """One live replica as its heartbeat and this router see it."""

    replica_id: str
    running: float
    waiting: float
    kv_usage: float
    tokens_per_s: float
    heartbeat_age_s: float
    inflight: int
    share_alarm: bool = False  # over its fair share lately (``router/share_alarm.py``)
    engine: str = "kvmesh"  # what computes its model (its record's, set by the deployment)
    hardware: str = ""


class RouterMetrics(ServerMetrics):
    def __init__(self, model_name: str = "", registry: MetricsRegistry | None = None) -> None:
        super().__init__(model_name, registry)
        self._declare_requests()
        self._declare_flow()
        self._declare_index_trust()
        self.set_overall_state(STATES[0])

    def _declare_requests(self) -> None:
        """What happens to the requests: outcomes, latency, decisions, failovers."""
        self.requests = self.counter(
            "kvmesh_router_requests", "Generate requests by outcome", ("policy", "outcome")
        )
        self.ttft = self.histogram(
            "kvmesh_router_time_to_first_token_seconds",
            "Time to first token through the router",
            TTFT_BUCKETS,
        )
        self.latency = self.histogram(
            "kvmesh_router_e2e_request_latency_seconds",
            "Request latency through the router",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decisions = self.counter(
            "kvmesh_router_routing_decisions", "Requests sent, by replica", ("replica",)
        )
        self.branches = self.counter(
            "kvmesh_router_decision_branches",
            "Routing decisions by the policy's reason",
            ("policy", "branch"),
        )
        self.retries = self.counter("kvmesh_router_failovers", "Requests retried on another replica")

    def _declare_flow(self) -> None:
        """Flow control and migration, the index entries skipped, relayed streams."""
        self.flow_queued = self.counter(
            "kvmesh_router_flow_queued",
            "Requests that waited at the router for a saturated fleet, by band and tenant",
            ("band", "tenant"),
        )
        self.flow_waited = self.histogram(
            "kvmesh_router_flow_wait_seconds",
            "How long requests waited at the router, by band and tenant",
            TTFT_BUCKETS,
            ("band", "tenant"),
        )
        self.flow_shed = self.counter(
            "kvmesh_router_flow_shed",
            "Requests refused by flow control, by band, tenant and why (full, ttl, shed)",
            ("band", "tenant", "reason"),
        )
        self.migrations = self.counter(
            "kvmesh_router_migrations",
            "Streams cut midway by their replica: moved to another, or refused (the limit, n > 1, none left)",
            ("outcome",),
        )
        self.index_skipped = self.counter(
            "kvmesh_router_index_skipped_entries",
            "Index entries read and skipped as malformed, by kind (record, load)",
            ("kind",),
        )
        self.relayed = self.counter(
            "kvmesh_router_relayed_streams",
            "Streamed HTTP requests relayed from their replica's own OpenAI port, byte for byte",
        )

    def _declare_index_trust(self) -> None:
        """What the index predicted against what replicas reused, trust, the shared load."""
        self.fleet_best_cached = self.counter(
            "kvmesh_router_fleet_best_cached_tokens", "Prompt tokens the best-holding replica had cached"
        )
        self.predicted_cached = self.counter(
            "kvmesh_router_predicted_cached_tokens", "Prompt tokens the router expected to be cached"
        )
        self.actual_cached = self.counter(
            "kvmesh_router_actual_cached_tokens", "Prompt tokens the replicas reported cached"
        )
        self.predicted_host_cached = self.counter(
            "kvmesh_router_predicted_host_cached_tokens",
            "Of the prompt tokens the router expected to be cached, those in replicas' host tiers",
        )
        self.actual_host_cached = self.counter(
            "kvmesh_router_actual_host_cached_tokens",
            "Of the prompt tokens the replicas reported cached, those restored from their host tiers",
        )
        self.prompt_tokens = self.counter("kvmesh_router_prompt_tokens", "Prompt tokens routed")
        self.prediction_error = self.histogram(
            "kvmesh_router_prediction_error_blocks",
            "Predicted minus reused prefix blocks, per request",
            PREDICTION_ERROR_BUCKETS,
        )
        self.misses = self.counter(
            "kvmesh_router_prediction_misses",
            "Requests whose reuse differed from the prediction",
            ("replica", "cause"),
        )
        self.restarts = self.counter(
            "kvmesh_router_replica_restarts", "Replica processes seen to restart", ("replica",)
        )
        self.resyncs = self.counter("kvmesh_router_index_resyncs", "Resyncs asked of a replica", ("replica",))
        self.replica_index_state = self.gauge(
            "kvmesh_router_replica_index_state",
            "1 for the router's trust in a replica's index entries",
            ("replica", "state"),
        )
        self.state_changes = self.counter(
            "kvmesh_router_replica_index_state_changes",
            "Changes of the router's trust in a replica's index entries, by new state and cause",
            ("replica", "state", "cause"),
        )
        self.index_state = self.gauge(
            "kvmesh_router_index_state", "1 for the router's trust in the index", ("state",)
        )
        self.lookup = self.histogram(
            "kvmesh_router_index_lookup_seconds", "Prefix index lookup latency", FAST_BUCKETS
        )
        self.decision = self.histogram(
            "kvmesh_router_decision_seconds",
            "Routing decision: tokenize + hash + lookup + choose",
            FAST_BUCKETS,
        )
        self.index_errors = self.counter("kvmesh_router_index_errors", "Lookups that fell back to load only")
        self.fleet_sync = self.histogram(
            "kvmesh_router_fleet_sync_seconds",
            "Shared load's race window: from a reservation or speculative entry made here to the index "
            "applying it (other routers miss it meanwhile)",
            FAST_BUCKETS,
        )
        self.fleet_routers = self.gauge(
            "kvmesh_router_fleet_routers",
            "Routers registered in this deployment as of this router's last heartbeat, itself included "
            "(1: alone, nothing shared per request)",
        )
        self.share_alarms = self.counter(
            "kvmesh_router_share_alarms",
            "Share alarms turned on: a replica took far over its fair share of new prefixes",
        )

    def count_share_alarm(self, change: Change) -> None:
        """A share alarm listener (``registry.alarm_listeners``): counts those turned on."""
        if change.on:
            self.share_alarms.inc()

    def set_index_state(self, replica_id: str, state: str) -> None:
        for s in STATES:
            self.replica_index_state.labels(replica_id, s).set(1 if s == state else 0)

    def set_overall_state(self, state: str) -> None:
        for s in STATES:
            self.index_state.labels(s).set(1 if s == state else 0)

    def forget_replica(self, replica_id: str) -> None:
        """A replica left: its labelled series go (its counters' history stays in Prometheus)."""
        for s in STATES:
            with contextlib.suppress(KeyError):
                self.replica_index_state.remove(replica_id, s)

    def watch_replicas(
        self, gauges: Callable[[], Iterable[ReplicaGauges]], index_up: Callable[[], bool]
    ) -> None:
        """Per-replica gauges and the index's reachability, read at each scrape (one collector
        for every model of this router: a family appears once on the page)."""
        self.registry.family("kvmesh_router_replica_gauges", _ReplicaCollector).watch(
            self.model_name, gauges, index_up
        )


class _ReplicaCollector:
    FIELDS: ClassVar[dict[str, tuple[str, str]]] = {
        "running": (
            "kvmesh_router_replica_running_requests",
            "Requests running on a replica (its heartbeat)",
        ),
        "waiting": (
            "kvmesh_router_replica_waiting_requests",
            "Requests waiting on a replica (its heartbeat)",
        ),
        "kv_usage": (
            "kvmesh_router_replica_kv_cache_usage_perc",
            "A replica's KV blocks in use, 0-1 (its heartbeat)",
        ),
        "tokens_per_s": (
            "kvmesh_router_replica_generation_tokens_per_second",
            "A replica's decode rate (its heartbeat)",
        ),
        "heartbeat_age_s": (
            "kvmesh_router_replica_heartbeat_age_seconds",
            "Seconds since a replica's last heartbeat",
        ),
        "inflight": (
            "kvmesh_router_replica_inflight_requests",
            "Requests this router has streaming on a replica",
        ),
        "share_alarm": (
            "kvmesh_router_replica_share_alarm",
            "1 while a replica's share alarm is on: it gets no prompt it would compute from scratch",
        ),
    }

    def __init__(self) -> None:
        self.models: list[tuple[str, Callable[[], Iterable[ReplicaGauges]], Callable[[], bool]]] = []

    def watch(
        self, model_name: str, gauges: Callable[[], Iterable[ReplicaGauges]], index_up: Callable[[], bool]
    ) -> None:
        self.models.append((model_name, gauges, index_up))

    def describe(self):
        return []  # collected lazily: no describe-time read of the registry

    def collect(self):
        families = {
            attr: GaugeMetricFamily(name, doc, labels=["model_name", "replica"])
            for attr, (name, doc) in self.FIELDS.items()
        }
        families["live"] = GaugeMetricFamily(
            "kvmesh_router_live_replicas", "Replicas a request may go to", labels=["model_name"]
        )
        up = GaugeMetricFamily(
            "kvmesh_router_index_up", "1 while the prefix index is reachable and whole", labels=["model_name"]
        )
        info = GaugeMetricFamily(
            "kvmesh_router_replica_info",
            "1 for each live replica, labelled by its engine and hardware (its index record's)",
            labels=["model_name", "replica", "engine", "hardware"],
        )
        for model_name, gauges, index_up in self.models:
            rows = list(gauges())
            for row in rows:
                for attr, family in families.items():
                    if attr != "live":
                        family.add_metric([model_name, row.replica_id], getattr(row, attr))
                info.add_metric([model_name, row.replica_id, row.engine, row.hardware], 1)
            families["live"].add_metric([model_name], len(rows))
            up.add_metric([model_name], 1 if index_up() else 0)
        yield from families.values()
        yield up
        yield info


def engine_label(engine: str | None) -> str:
    """A replica's engine as a label: one of the known kinds, "other" for anything else a
    record may hold (no unbounded label values from the index)."""
    engine = engine or "kvmesh"
    return engine if engine in ENGINE_KINDS else "other"


def heartbeat_age(heartbeat_at: float) -> float:
    return max(0.0, time.time() - heartbeat_at) if heartbeat_at else 0.0
