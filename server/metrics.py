"""Prometheus metrics: request counts, latency histograms, batch sizes, queue depth, workers.

Each server has its own `CollectorRegistry` (no process-global state), scraped on the metrics
port. Hot-path code holds pre-bound label children (`VersionMetrics`) so an observation is one
lock and an add. Queue depth and worker states are read from the model registry at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    120.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class VersionStats:
    """What the scrape reads from one model version."""

    model: str
    version: str
    state: str
    queue_depth: int
    workers: dict[str, int]


class _LiveCollector(Collector):
    def __init__(self, source: Callable[[], Iterable[VersionStats]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "scriptserve_queue_depth", "Requests waiting for a worker", labels=["model", "version"]
        )
        workers = GaugeMetricFamily(
            "scriptserve_workers", "Workers by state", labels=["model", "version", "state"]
        )
        models = GaugeMetricFamily(
            "scriptserve_model_state", "1 for the state each model version is in",
            labels=["model", "version", "state"],
        )  # fmt: skip
        for s in self._source():
            depth.add_metric([s.model, s.version], s.queue_depth)
            for state, count in s.workers.items():
                workers.add_metric([s.model, s.version, state], count)
            models.add_metric([s.model, s.version, s.state], 1)
        yield from (depth, workers, models)


class VersionMetrics:
    """Label-bound metric children for one model version (used from worker threads)."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        self.queue_latency = metrics.queue_latency.labels(model, version)
        self.inference_latency = metrics.inference_latency.labels(model, version)
        self.batch_size = metrics.batch_size.labels(model, version)
        self.worker_restarts = metrics.worker_restarts.labels(model, version)
        self.workers_stuck = metrics.workers_stuck.labels(model, version)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "scriptserve_requests", "Inference requests answered",
            ["model", "version", "protocol", "status"], registry=self.registry,
        )  # fmt: skip
        self.request_latency = Histogram(
            "scriptserve_request_latency_seconds", "End-to-end latency, arrival to answer",
            ["model", "version", "protocol"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.queue_latency = Histogram(
            "scriptserve_queue_latency_seconds", "Time from arrival until a worker took it",
            ["model", "version"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.inference_latency = Histogram(
            "scriptserve_inference_latency_seconds", "Handler time per batch",
            ["model", "version"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_size = Histogram(
            "scriptserve_batch_size", "Requests per batch run by a worker",
            ["model", "version"], buckets=_BATCH_BUCKETS, registry=self.registry,
        )  # fmt: skip
        # Label children of observe_request, looked up once: labels() costs a lock and a tuple.
        # Bounded: unknown model names are all labelled "_unknown".
        self._request_children: dict[tuple[str, str, str, int], tuple[Any, Any]] = {}
        self.worker_restarts = Counter(
            "scriptserve_worker_restarts", "Workers replaced after dying or hanging",
            ["model", "version"], registry=self.registry,
        )  # fmt: skip
        self.workers_stuck = Counter(
            "scriptserve_workers_stuck", "Workers stuck in one call past the response timeout",
            ["model", "version"], registry=self.registry,
        )  # fmt: skip
        self.client_disconnects = Counter(
            "scriptserve_client_disconnects", "HTTP requests whose client went away mid-body",
            ["api"], registry=self.registry,
        )  # fmt: skip

    def watch(self, source: Callable[[], Iterable[VersionStats]]) -> None:
        """Report queue depth, workers and model states from `source` at every scrape."""
        self.registry.register(_LiveCollector(source))

    def for_version(self, model: str, version: str) -> VersionMetrics:
        return VersionMetrics(self, model, version)

    def observe_request(
        self, model: str, version: str, protocol: str, status: int, seconds: float
    ) -> None:
        key = (model, version, protocol, status)
        children = self._request_children.get(key)
        if children is None:
            children = (
                self.requests.labels(model, version, protocol, str(status)),
                self.request_latency.labels(model, version, protocol),
            )
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
