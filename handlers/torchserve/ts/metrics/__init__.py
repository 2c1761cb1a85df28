"""`context.metrics`: TorchServe's custom metrics API, exported on the server's `/metrics`.

Every call records into the model version's handler metrics (handlers/metrics.py): counters as
Prometheus counters (`<name>_total`), gauges (`add_time`, `add_size`, `add_percent` and gauge
metrics) as gauges, histograms as summaries (`_count`, `_sum`), each with the model's name and
version and the call's dimensions, plus TorchServe's defaults `ModelName` and `Level`. Metrics
declared in TorchServe's metrics.yaml (`model_metrics`, named by the server's `metrics_config`)
exist from the start, so `get_metric(name, type)` finds them, with the dimension names the file
gives. Each value is also logged at DEBUG with the model name and request id, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from scriptserve.handlers.metrics import HandlerMetrics, Kind

from .dimension import Dimension
from .metric_type_enum import MetricTypes

__all__ = ["Dimension", "Metric", "MetricTypes", "MetricsCache", "MetricsCacheKeyError"]

log = logging.getLogger("scriptserve.torchserve.metrics")

_KINDS: dict[str, Kind] = {"counter": "counter", "gauge": "gauge", "histogram": "summary"}


class MetricsCacheKeyError(KeyError):
    """`get_metric` of a metric that is neither declared nor recorded (TorchServe's name)."""


def _kind(metric_type: Any) -> Kind:
    name = str(getattr(metric_type, "value", metric_type)).lower()
    if name not in _KINDS:
        raise ValueError(f"metric type {metric_type!r}: use COUNTER, GAUGE or HISTOGRAM")
    return _KINDS[name]


class Metric:
    """A metric from `add_metric_to_cache` or `get_metric`: values go to the cache's store
    with its dimension names."""

    def __init__(
        self,
        cache: MetricsCache,
        name: str,
        unit: str,
        dimension_names: Sequence[str],
        metric_type: Any,
    ) -> None:
        self.cache = cache
        self.name = name
        self.unit = unit
        self.dimension_names = list(dimension_names)
        self.metric_type = metric_type
        self.kind = _kind(metric_type)

    def add_or_update(
        self,
        value: float,
        dimension_values: Sequence[str] | None = None,
        request_id: str | None = None,
    ) -> None:
        values = [str(v) for v in dimension_values or ()]
        if len(values) != len(self.dimension_names):
            raise ValueError(
                f"metric {self.name!r} has dimensions {self.dimension_names}; got "
                f"{len(values)} value(s)"
            )
        dims = dict(zip(self.dimension_names, values, strict=True))
        self.cache.record(self.kind, self.name, value, dims, request_id)

    def update(self, value: float) -> None:
        self.add_or_update(value, [""] * len(self.dimension_names))


class MetricsCache:
    """TorchServe's metrics cache API over a model version's HandlerMetrics."""

    def __init__(
        self,
        model_name: str = "",
        store: HandlerMetrics | None = None,
        declarations: Iterable[tuple[str, str, str, Sequence[str]]] = (),
    ) -> None:
        self.model_name = model_name
        self.store = store if store is not None else HandlerMetrics()
        self.request_ids: dict[int, str] = {}
        self._metrics: dict[str, Metric] = {}
        for kind, name, unit, dimension_names in declarations:
            self.add_metric_to_cache(name, unit, dimension_names, kind)

    def set_request_ids(self, request_ids: dict[int, str]) -> None:
        self.request_ids = request_ids

    def record(
        self,
        kind: Kind,
        name: str,
        value: float,
        dims: dict[str, str],
        request_id: str | None = None,
    ) -> None:
        if kind == "counter":
            self.store.counter(name, float(value), **dims)
        elif kind == "gauge":
            self.store.gauge(name, float(value), **dims)
        else:
            self.store.observe(name, float(value), **dims)
        log.debug(
            "model=%s request_id=%s metric %s=%g (%s)",
            self.model_name,
            request_id,
            name,
            value,
            kind,
        )

    def _with_defaults(self, dimensions: Iterable[Any] | None) -> dict[str, str]:
        dims = {d.name: str(d.value) for d in dimensions or ()}
        dims.setdefault("ModelName", self.model_name)
        dims.setdefault("Level", "Model")
        return dims

    def _add(self, name: str, value: float, idx: int | None, dimensions: Any, kind: Kind) -> None:
        request_id = self.request_ids.get(idx) if idx is not None else None
        self.record(kind, name, value, self._with_defaults(dimensions), request_id)

    def add_metric(
        self,
        name: str,
        value: float,
        unit: str = "count",
        idx: int | None = None,
        dimensions: Any = None,
        metric_type: Any = MetricTypes.COUNTER,
    ) -> None:
        self._add(name, value, idx, dimensions, _kind(metric_type))

    def add_counter(
        self, name: str, value: float, idx: int | None = None, dimensions: Any = None
    ) -> None:
        self._add(name, value, idx, dimensions, "counter")

    def add_time(
        self,
        name: str,
        value: float,
        idx: int | None = None,
        unit: str = "ms",
        dimensions: Any = None,
        metric_type: Any = MetricTypes.GAUGE,
    ) -> None:
        if unit not in ("ms", "s"):
            raise ValueError("the unit for a timed metric should be one of ['ms', 's']")
        self._add(name, value, idx, dimensions, _kind(metric_type))

    def add_size(
        self,
        name: str,
        value: float,
        idx: int | None = None,
        unit: str = "MB",
        dimensions: Any = None,
        metric_type: Any = MetricTypes.GAUGE,
    ) -> None:
        if unit not in ("MB", "kB", "GB", "B"):
            raise ValueError("the unit for a size metric is one of ['MB', 'kB', 'GB', 'B']")
        self._add(name, value, idx, dimensions, _kind(metric_type))

    def add_percent(
        self,
        name: str,
        value: float,
        idx: int | None = None,
        dimensions: Any = None,
        metric_type: Any = MetricTypes.GAUGE,
    ) -> None:
        self._add(name, value, idx, dimensions, _kind(metric_type))

    def add_error(self, name: str, value: float, dimensions: Any = None) -> None:
        dims = {d.name: str(d.value) for d in dimensions or ()}
        dims.setdefault("Level", "Error")
        self.record("counter", name, value, dims)

    def add_metric_to_cache(
        self,
        metric_name: str,
        unit: str,
        dimension_names: Sequence[str] | None = None,
        metric_type: Any = MetricTypes.COUNTER,
    ) -> Metric:
        metric = self._metrics.get(metric_name)
        if metric is None:
            names = list(dimension_names or ())
            metric = Metric(self, metric_name, unit, names, metric_type)
            self.store.declare(metric.kind, metric_name)
            self._metrics[metric_name] = metric
        return metric

    def get_metric(self, metric_name: str, metric_type: Any = MetricTypes.COUNTER) -> Metric:
        metric = self._metrics.get(metric_name)
        if metric is None:
            raise MetricsCacheKeyError(f"metric {metric_name!r} is neither declared nor recorded")
        return metric
