"""What the router's and the replicas' Prometheus metrics share: one registry per server (so
tests can run several in one process; a router's models share its one) with the process collectors, the ``model_name``
label, vLLM's histogram buckets, and the exposition.

Replicas export vLLM's metric names (``vllm:num_requests_running``, ...) with vLLM's
semantics and buckets, so the dashboards, autoscalers and gateways built for vLLM read a
kvmesh replica as they read vLLM; what vLLM has no name for is ``kvmesh_*``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

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

T = TypeVar("T")

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


class MetricsRegistry(CollectorRegistry):
    """One server's registry, with the process collectors: the metrics of every model it
    serves share it, each family registered once (``family``) and labelled by model."""

    def __init__(self) -> None:
        super().__init__()
        ProcessCollector(registry=self)
        PlatformCollector(registry=self)
        GCCollector(registry=self)
        self._families: dict[str, object] = {}

    def family(self, name: str, make: Callable[[], T]) -> T:
        """The metric (or collector) called ``name``, made and registered by its first user."""
        if name not in self._families:
            self._families[name] = made = make()
            if not isinstance(made, Counter | Gauge | Histogram):  # those register themselves
                self.register(made)
        return self._families[name]

    def render(self) -> bytes:
        return generate_latest(self)


class ServerMetrics:
    """Base of a server's metrics: subclasses declare theirs with ``self.counter`` /
    ``self.histogram`` / ``self.gauge``, which bind this model's ``model_name`` label. Each
    model a server serves has its own instance over the server's one ``registry``."""

    def __init__(self, model_name: str, registry: MetricsRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or MetricsRegistry()

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        """A counter for this model: ``.inc()``, or ``.labels(*values).inc()`` with ``labels``."""
        return self._declare(Counter, name, doc, labels)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()):
        return self._declare(Histogram, name, doc, labels, buckets=buckets)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        return self._declare(Gauge, name, doc, labels)

    def _declare(self, kind: type, name: str, doc: str, labels: tuple[str, ...], **options):
        def make():
            return kind(name, doc, ["model_name", *labels], registry=self.registry, **options)

        metric = self.registry.family(name, make)
        return _ModelBound(metric, self.model_name) if labels else metric.labels(self.model_name)

    def render(self) -> bytes:
        return self.registry.render()


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
