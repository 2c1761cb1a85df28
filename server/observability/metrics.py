"""Prometheus metrics: request counts, latency histograms, batch sizes, queue depth, workers.

Each server has its own `CollectorRegistry` (no process-global state), scraped on the metrics
port. Hot-path code holds pre-bound label children (`VersionMetrics`) so an observation is one
lock and an add. Queue depth and worker states are read from the model registry at scrape time.
Every observation of a model version also goes into its Triton statistics
(`server/observability/statistics.py`), which the statistics extension answers with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scriptserve.handlers.base import InferenceRequest, StageTimes
from scriptserve.handlers.metrics import HandlerMetrics
from scriptserve.server.observability.gauges import GpuCollector, WorkerCollector, WorkerGauge
from scriptserve.server.observability.handler_metrics import HandlerMetricsCollector
from scriptserve.server.observability.statistics import VersionStatistics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    120.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COMPUTE_STAGES = ("input", "infer", "output")


@dataclass(frozen=True)
class VersionStats:
    """What the scrape reads from one model version."""

    model: str
    version: str
    state: str
    queue_depth: int
    workers: dict[str, int]
    resident_bytes: int = 0
    """What its workers hold, measured when they loaded (0 while unloaded)."""


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
            "scriptserve_model_state",
            "1 for the state each model version is in",
            labels=["model", "version", "state"],
        )
        resident = GaugeMetricFamily(
            "scriptserve_model_resident_bytes",
            "Memory a model version's workers hold, measured at its load (0 while unloaded)",
            labels=["model", "version"],
        )
        for s in self._source():
            resident.add_metric([s.model, s.version], s.resident_bytes)
            depth.add_metric([s.model, s.version], s.queue_depth)
            for state, count in s.workers.items():
                workers.add_metric([s.model, s.version, state], count)
            models.add_metric([s.model, s.version, s.state], 1)
        yield from (depth, workers, models, resident)


@dataclass(frozen=True)
class MemoryStats:
    """What the scrape reads from the memory budget (server/models/memory.py)."""

    budget_bytes: int | None
    baseline_bytes: int
    accounted_bytes: int
    resident_bytes: int
    """The server's resident size: its process and its worker processes."""


class _MemoryCollector(Collector):
    def __init__(self, source: Callable[[], MemoryStats]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats = self._source()
        if stats.budget_bytes is not None:
            yield GaugeMetricFamily(
                "scriptserve_memory_budget_bytes",
                "The memory the server may hold, models included (--memory-budget)",
                value=stats.budget_bytes,
            )
        yield GaugeMetricFamily(
            "scriptserve_memory_baseline_bytes",
            "The server's resident size before any model loaded",
            value=stats.baseline_bytes,
        )
        yield GaugeMetricFamily(
            "scriptserve_memory_accounted_bytes",
            "The baseline and every loaded model's resident bytes, measured at their loads",
            value=stats.accounted_bytes,
        )
        yield GaugeMetricFamily(
            "scriptserve_memory_resident_bytes",
            "The server's resident size, its worker processes included (the budget counts "
            "this or the accounted bytes, whichever is more)",
            value=stats.resident_bytes,
        )


def _rows(request: InferenceRequest) -> int:
    """The batch dimension a request adds to its batch (1 without tensors)."""
    for array in request.inputs.values():
        return int(array.shape[0]) if array.ndim else 1
    return 1


class VersionMetrics:
    """Label-bound metric children for one model version (used from worker threads)."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        self.queue_latency = metrics.queue_latency.labels(model, version)
        self.inference_latency = metrics.inference_latency.labels(model, version)
        self.compute = tuple(
            metrics.compute_latency.labels(model, version, stage) for stage in COMPUTE_STAGES
        )
        self.batch_size = metrics.batch_size.labels(model, version)
        self.worker_restarts = metrics.worker_restarts.labels(model, version)
        self.workers_stuck = metrics.workers_stuck.labels(model, version)
        self.statistics = metrics.statistics_of(model, version)

    def observe_taken(self, waits: Sequence[float]) -> None:
        """A worker took a batch whose requests waited `waits` seconds each in the queue."""
        for seconds in waits:
            self.queue_latency.observe(seconds)
        self.batch_size.observe(len(waits))
        self.statistics.taken(waits)

    def observe_batch(
        self, requests: Sequence[InferenceRequest], seconds: float, times: StageTimes
    ) -> None:
        """A worker ran a batch in `seconds`, of which `times` says the input and output
        stages' share; the rest is the model's."""
        self.inference_latency.observe(seconds)
        stages = (times.input_s, max(0.0, seconds - times.input_s - times.output_s), times.output_s)
        for child, stage_s in zip(self.compute, stages, strict=True):
            child.observe(stage_s)
        rows = sum(_rows(request) for request in requests)
        self.statistics.ran(len(requests), rows, *stages)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "scriptserve_requests",
            "Inference requests answered",
            ["model", "version", "protocol", "status"],
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "scriptserve_request_latency_seconds",
            "End-to-end latency, arrival to answer",
            ["model", "version", "protocol"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_latency = Histogram(
            "scriptserve_queue_latency_seconds",
            "Time from arrival until a worker took it",
            ["model", "version"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inference_latency = Histogram(
            "scriptserve_inference_latency_seconds",
            "Handler time per batch",
            ["model", "version"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.compute_latency = Histogram(
            "scriptserve_compute_seconds",
            "Handler time per batch by stage: input (preprocess), infer (the model), output "
            "(postprocess)",
            ["model", "version", "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "scriptserve_batch_size",
            "Requests per batch run by a worker",
            ["model", "version"],
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        # Label children of observe_request, looked up once: labels() costs a lock and a tuple.
        # Bounded: unknown model names are all labelled "_unknown".
        self._request_children: dict[
            tuple[str, str, str, int], tuple[Any, Any, VersionStatistics | None]
        ] = {}
        self._statistics: dict[tuple[str, str], VersionStatistics] = {}
        self.worker_restarts = Counter(
            "scriptserve_worker_restarts",
            "Workers replaced after dying or hanging",
            ["model", "version"],
            registry=self.registry,
        )
        self.workers_stuck = Counter(
            "scriptserve_workers_stuck",
            "Workers stuck in one call past the response timeout",
            ["model", "version"],
            registry=self.registry,
        )
        self.model_loads = Counter(
            "scriptserve_model_loads",
            "Loads of a model version's workers (at registration, or on a request to a parked one)",
            ["model", "version"],
            registry=self.registry,
        )
        self.model_evictions = Counter(
            "scriptserve_model_evictions",
            "Model versions unloaded, idle, to make room under the memory budget",
            ["model", "version"],
            registry=self.registry,
        )
        self.model_load_waits = Counter(
            "scriptserve_model_load_waits",
            "Requests that waited for their model version to load",
            ["model", "version"],
            registry=self.registry,
        )
        self.model_load_seconds = Histogram(
            "scriptserve_model_load_seconds",
            "Time to start a model version's workers, warm-up included",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "scriptserve_client_disconnects",
            "HTTP requests whose client went away mid-body",
            ["api"],
            registry=self.registry,
        )

    def watch(
        self,
        source: Callable[[], Iterable[VersionStats]],
        workers: Callable[[], Iterable[WorkerGauge]] | None = None,
        handlers: Callable[[], Iterable[tuple[str, str, HandlerMetrics]]] | None = None,
        memory: Callable[[], MemoryStats] | None = None,
    ) -> None:
        """Report queue depth, workers and model states from `source` at every scrape, each
        worker from `workers`, the handlers' own metrics from `handlers`
        (server/observability/handler_metrics.py), the memory budget from `memory`, the server
        process and the GPUs
        (server/observability/gauges.py)."""
        self.registry.register(_LiveCollector(source))
        if workers is not None:
            self.registry.register(WorkerCollector(workers))
        if handlers is not None:
            self.registry.register(HandlerMetricsCollector(handlers))
        if memory is not None:
            self.registry.register(_MemoryCollector(memory))
        self.registry.register(ProcessCollector(registry=None))
        self.registry.register(GpuCollector())

    def for_version(self, model: str, version: str) -> VersionMetrics:
        return VersionMetrics(self, model, version)

    def statistics_of(self, model: str, version: str) -> VersionStatistics:
        """The version's Triton statistics; kept across unload and reload, like its counters."""
        key = (model, version)
        stats = self._statistics.get(key)
        if stats is None:
            stats = self._statistics.setdefault(key, VersionStatistics(model, version))
        return stats

    def statistics(self, model: str, version: str) -> VersionStatistics | None:
        """The version's statistics, or None if it never was loaded."""
        return self._statistics.get((model, version))

    def observe_request(
        self, model: str, version: str, protocol: str, status: int, seconds: float
    ) -> None:
        key = (model, version, protocol, status)
        children = self._request_children.get(key)
        if children is None:
            children = (
                self.requests.labels(model, version, protocol, str(status)),
                self.request_latency.labels(model, version, protocol),
                self._statistics.get((model, version)),  # None: not a version that loaded
            )
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if children[2] is not None:
            children[2].answered(status == 200, seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
