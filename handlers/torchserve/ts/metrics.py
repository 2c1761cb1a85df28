"""`context.metrics`: the calls handlers make to record custom metrics.

Values are logged (DEBUG, logger `scriptserve.torchserve.metrics`, with the model name and the
request id) and the last value of each metric is kept for inspection; they are not exported to
the Prometheus endpoint, whose series the server defines itself.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("scriptserve.torchserve.metrics")


class Metric:
    def __init__(self, name: str, unit: str, metric_type: str) -> None:
        self.name = name
        self.unit = unit
        self.metric_type = metric_type
        self.value: float = 0.0

    def add_or_update(self, value: float, dimension_values: list[str] | None = None,
                      request_id: str | None = None) -> None:  # fmt: skip
        self.value = self.value + value if self.metric_type == "COUNTER" else value

    def update(self, value: float) -> None:
        self.add_or_update(value)


class MetricsCache:
    """TorchServe's metrics cache API, backed by log lines."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.request_ids: dict[int, str] = {}
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()

    def _record(self, name: str, value: float, idx: int | None, unit: str, kind: str) -> None:
        with self._lock:
            metric = self._metrics.get(name)
            if metric is None:
                metric = self._metrics[name] = Metric(name, unit, kind)
            metric.add_or_update(float(value))
        request_id = self.request_ids.get(idx) if idx is not None else None
        log.debug(
            "model=%s request_id=%s metric %s=%g %s (%s)",
            self.model_name, request_id, name, value, unit, kind.lower(),
        )  # fmt: skip

    def add_metric(self, name: str, value: float, unit: str = "count", idx: int | None = None,
                   dimensions: Any = None, metric_type: str = "GAUGE") -> None:  # fmt: skip
        self._record(name, value, idx, unit, str(getattr(metric_type, "name", metric_type)))

    def add_counter(self, name: str, value: float, idx: int | None = None,
                    dimensions: Any = None) -> None:  # fmt: skip
        self._record(name, value, idx, "count", "COUNTER")

    def add_time(self, name: str, value: float, idx: int | None = None, unit: str = "ms",
                 dimensions: Any = None, metric_type: str = "GAUGE") -> None:  # fmt: skip
        self._record(name, value, idx, unit, "GAUGE")

    def add_size(self, name: str, value: float, idx: int | None = None, unit: str = "MB",
                 dimensions: Any = None, metric_type: str = "GAUGE") -> None:  # fmt: skip
        self._record(name, value, idx, unit, "GAUGE")

    def add_percent(self, name: str, value: float, idx: int | None = None,
                    dimensions: Any = None, metric_type: str = "GAUGE") -> None:  # fmt: skip
        self._record(name, value, idx, "percent", "GAUGE")

    def add_metric_to_cache(self, metric_name: str, unit: str, dimension_names: Any = None,
                            metric_type: str = "COUNTER") -> Metric:  # fmt: skip
        with self._lock:
            metric = self._metrics.get(metric_name)
            if metric is None:
                kind = str(getattr(metric_type, "name", metric_type))
                metric = self._metrics[metric_name] = Metric(metric_name, unit, kind)
            return metric

    def get_metric(self, metric_name: str, metric_type: Any = None) -> Metric:
        with self._lock:
            if metric_name not in self._metrics:
                raise KeyError(f"metric {metric_name!r} was never recorded")
            return self._metrics[metric_name]

    def value(self, name: str) -> float | None:
        """The last value (or a counter's sum) recorded for `name`."""
        metric = self._metrics.get(name)
        return metric.value if metric else None
