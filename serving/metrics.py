"""What the router's and the replicas' Prometheus metrics share: one registry per server (so
tests can run several in one process) with the process collectors, the ``model_name``
label, vLLM's histogram buckets, and the exposition.

Replicas export vLLM's metric names (``vllm:num_requests_running``, ...) with vLLM's
semantics and buckets, so the dashboards, autoscalers and gateways built for vLLM read a
kvmesh replica as they read vLLM; what vLLM has no name for is ``kvmesh_*``.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

# vLLM's buckets (vllm/v1/metrics/loggers.py), so percentiles agree across both.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)  # router internals


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1-2-5 buckets up to the context length (vLLM's request token histograms)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    """Base of a server's metrics: subclasses register theirs on ``self.registry``, each with
    a ``model_name`` label (``self.counter`` / ``self.histogram`` bind it)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        """A counter for this model: ``.inc()``, or ``.labels(*values).inc()`` with ``labels``."""
        return self._bind(Counter(name, doc, ["model_name", *labels], registry=self.registry), labels)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()):
        metric = Histogram(name, doc, ["model_name", *labels], buckets=buckets, registry=self.registry)
        return self._bind(metric, labels)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        return self._bind(Gauge(name, doc, ["model_name", *labels], registry=self.registry), labels)

    def _bind(self, metric, labels: tuple[str, ...]):
        return _ModelBound(metric, self.model_name) if labels else metric.labels(self.model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def read_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page as {(sample name, sorted labels but model_name): value}, for readers
    (benchmarks, tests, the pod exporter) that do not care which model a server serves."""
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class _ModelBound:
    """A labelled metric whose ``model_name`` is already given: ``.labels(*the other values)``."""

    def __init__(self, metric, model_name: str) -> None:
        self._metric = metric
        self._model_name = model_name

    def labels(self, *values: str):
        return self._metric.labels(self._model_name, *values)

    def remove(self, *values: str) -> None:
        self._metric.remove(self._model_name, *values)
