"""A replica's Prometheus metrics, under vLLM's names where vLLM has one.

Request metrics (TTFT, inter-token latency, end-to-end, queue/prefill/decode/inference
time, prompt and generation lengths, successes by finish reason) are recorded per request;
engine and KV cache state (running/waiting, KV usage, prefix cache queries/hits in tokens,
preemptions) are read from the engine's stats at scrape time, with no polling thread.
kvmesh's own: requests by outcome (errors included), cached and finished prompt tokens
(the hit rate `bench peers` reads), the KV pool in blocks, evictions, the index's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.serving.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    token_buckets,
)
from kvmesh.serving.step_costs import TERMS

if TYPE_CHECKING:
    from kvmesh.engine.protocol import EngineStats, HostTierStats
    from kvmesh.engine.request import RequestOutput


class ReplicaMetrics(ServerMetrics):
    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], EngineStats]) -> None:
        super().__init__(model_name)
        self.requests = self.counter("kvmesh_replica_requests", "Requests by outcome", ("outcome",))
        self.success = self.counter(
            "vllm:request_success", "Finished requests by finish reason", ("finished_reason",)
        )
        self.ttft = self.histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = self.histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS
        )
        self.e2e = self.histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            REQUEST_LATENCY_BUCKETS,
        )
        phases = {
            "queue": "waiting for admission",
            "prefill": "admission to first token",
            "decode": "first token to the end",
            "inference": "admission to the end",
        }
        self.phase = {
            name: self.histogram(f"vllm:request_{name}_time_seconds", f"Time {doc}", REQUEST_LATENCY_BUCKETS)
            for name, doc in phases.items()
        }
        lengths = token_buckets(max_model_len)
        self.prompt_length = self.histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", lengths
        )
        self.generation_length = self.histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", lengths
        )
        self.cached_tokens = self.counter(
            "kvmesh_replica_cached_prompt_tokens", "Prompt tokens served from the prefix cache"
        )
        self.finished_prompt_tokens = self.counter(
            "kvmesh_replica_finished_prompt_tokens",
            "Prompt tokens of finished requests (the hit rate's denominator)",
        )
        self.registry.register(_EngineCollector(model_name, stats))

    def finished(self, out: RequestOutput) -> None:
        """A request's last output: its success, lengths and phase times."""
        self.success.labels(out.finish_reason or "abort").inc()
        self.cached_tokens.inc(out.cached_tokens)
        self.finished_prompt_tokens.inc(out.prompt_tokens)
        self.prompt_length.observe(out.prompt_tokens)
        self.generation_length.observe(out.completion_tokens)
        t = out.times
        if t is None:
            return
        if t.scheduled is not None:
            self.phase["queue"].observe(t.scheduled - t.arrival)
            self.phase["inference"].observe(t.finished - t.scheduled)
            if t.first_token is not None:
                self.phase["prefill"].observe(t.first_token - t.scheduled)
                self.phase["decode"].observe(t.finished - t.first_token)


class _EngineCollector:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def _host(self, host: HostTierStats):
        """The host tier: its size and use, the copies in and out, what it served."""
        families = (
            (
                GaugeMetricFamily,
                "kvmesh_replica_host_kv_blocks",
                "Blocks of the host KV tier",
                host.num_blocks,
            ),
            (
                GaugeMetricFamily,
                "kvmesh_replica_host_kv_used_blocks",
                "Host tier blocks holding KV",
                host.num_used_blocks,
            ),
            (
                GaugeMetricFamily,
                "kvmesh_replica_host_kv_bytes",
                "Host memory the host tier holds",
                host.bytes,
            ),
            (
                GaugeMetricFamily,
                "kvmesh_replica_host_restore_block_seconds",
                "A block's restore from the host tier lately, measured (0: none yet)",
                host.restore_block_s or 0.0,
            ),
            (
                CounterMetricFamily,
                "kvmesh_replica_host_offloaded_blocks",
                "Blocks copied to the host tier",
                host.offloaded_blocks,
            ),
            (
                CounterMetricFamily,
                "kvmesh_replica_host_restored_blocks",
                "Blocks copied back from the host tier",
                host.restored_blocks,
            ),
            (
                CounterMetricFamily,
                "kvmesh_replica_host_restore_seconds",
                "Time the restores took",
                host.restore_seconds,
            ),
            (
                CounterMetricFamily,
                "kvmesh_replica_host_cached_prompt_tokens",
                "Prompt tokens served from the host tier (of the prefix cache hits)",
                host.hit_tokens,
            ),
        )
        for kind, name, doc, value in families:
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def collect(self):
        s = self.stats()
        kv = s.kv
        usage = 1 - kv.num_free_blocks / kv.num_blocks if kv.num_blocks else 0.0
        gauges = {
            "vllm:num_requests_running": ("Requests in the running batch", s.num_running),
            "vllm:num_requests_waiting": ("Requests waiting for admission", s.num_waiting),
            "vllm:kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1)", usage),
            "kvmesh_replica_kv_blocks": ("KV blocks in the pool", kv.num_blocks),
            "kvmesh_replica_kv_free_blocks": ("KV blocks free (cached or empty)", kv.num_free_blocks),
            "kvmesh_replica_kv_cached_free_blocks": (
                "Free KV blocks still hittable",
                kv.num_cached_free_blocks,
            ),
            "kvmesh_replica_kv_cached_hashes": ("Block hashes a new request could hit", kv.num_cached_hashes),
            "kvmesh_replica_cuda_graph_capture_seconds": (
                "Seconds the start spent capturing decode CUDA graphs (0: none)",
                s.graph_capture_seconds,
            ),
            "kvmesh_replica_cuda_graph_bytes": (
                "Device memory the captured decode graphs hold",
                s.graph_capture_bytes,
            ),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        counters = {
            "vllm:prompt_tokens": ("Prompt tokens admitted", s.prompt_tokens),
            "vllm:generation_tokens": ("Tokens generated", s.generation_tokens),
            "vllm:num_preemptions": ("Requests preempted for KV space", s.num_preemptions),
            "vllm:prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache",
                kv.prefix_query_tokens,
            ),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache", kv.prefix_hit_tokens),
            "kvmesh_replica_kv_evictions": ("Cached blocks reused for new data", kv.evictions),
            "kvmesh_replica_cuda_graph_replays": ("Decode steps replayed from a CUDA graph", s.graph_replays),
        }
        if s.host is not None:
            yield from self._host(s.host)
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        costs = GaugeMetricFamily(
            "kvmesh_replica_step_cost_seconds",
            "What one engine step costs here, fitted online: base per step, per prompt token, per decoding "
            "sequence, per context token (engine/step_costs.py)",
            labels=["model_name", "term"],
        )
        for term, value in zip(TERMS, s.step_costs.terms(), strict=True):
            costs.add_metric([self.model_name, term.removesuffix("_s")], value)
        yield costs
