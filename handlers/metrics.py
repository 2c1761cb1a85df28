"""What a handler counts, times and gauges: `context.metrics`, exported on the server's
`/metrics` with the model's name and version and the handler's own dimensions.

    context.metrics.counter("cache_misses", 1, cache="tokens")
    context.metrics.gauge("queue_tokens", 512)
    with context.metrics.timer("tokenize_seconds"):
        ...
    context.metrics.observe("prompt_tokens", 37)   # a summary: its _count and _sum

A metric's name keeps what the handler gave (so dashboards built on TorchServe's names keep
working), made a valid Prometheus name (characters outside `[a-zA-Z0-9_:]` become `_`; a name
the server uses itself, `scriptserve_*`, `process_*` or `python_*`, is prefixed `handler_`). A
counter is exported as `<name>_total`. One name has one kind; recording it as another kind is
refused (ValueError), as Prometheus would refuse the scrape.

The store is shared by a model version's worker threads. A process worker keeps its own, whose
changes it sends with each batch's answers (`drain`), and the server adds them to the version's
(`merge`): counters and summaries add up, a gauge takes the latest value.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "summary"]
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")
_RESERVED = ("scriptserve_", "process_", "python_")
_RESERVED_LABELS = ("model", "version")


def metric_name(name: str) -> str:
    """`name` as a Prometheus metric name (see the module docstring)."""
    clean = _INVALID.sub("_", name) or "_"
    if clean[0].isdigit():
        clean = "_" + clean
    return "handler_" + clean if clean.startswith(_RESERVED) else clean


def label_name(name: str) -> str:
    """A dimension's name as a Prometheus label (`model` and `version` are the server's)."""
    clean = _INVALID.sub("_", name).replace(":", "_") or "_"
    if clean[0].isdigit() or clean.startswith("__"):
        clean = "_" + clean.lstrip("_")
    return "handler_" + clean if clean in _RESERVED_LABELS else clean


Dimensions = tuple[tuple[str, str], ...]


@dataclass
class Series:
    """One metric with one set of dimension values."""

    kind: Kind
    name: str
    dimensions: Dimensions
    value: float = 0.0
    """A counter's total, a gauge's value, a summary's sum."""
    count: int = 0
    """A summary's observations."""


class HandlerMetrics:
    """A model version's handler metrics (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, Dimensions], Series] = {}
        self._kinds: dict[str, Kind] = {}
        self._changed: set[tuple[str, Dimensions]] = set()
        self._drained: dict[tuple[str, Dimensions], tuple[float, int]] = {}

    def __reduce__(self) -> tuple[type[HandlerMetrics], tuple[()]]:
        # A process worker starts with an empty store of its own (its changes come back).
        return (HandlerMetrics, ())

    def _update(
        self, kind: Kind, name: str, value: float, count: int, dims: dict[str, Any]
    ) -> None:
        key = (metric_name(name), tuple(sorted((label_name(k), str(v)) for k, v in dims.items())))
        with self._lock:
            known = self._kinds.setdefault(key[0], kind)
            if known != kind:
                raise ValueError(f"metric {name!r} is a {known}; it cannot be recorded as a {kind}")
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = Series(kind, key[0], key[1])
            if kind == "gauge":
                series.value = value
            else:
                series.value += value
                series.count += count
            self._changed.add(key)

    def counter(self, name: str, value: float = 1.0, **dimensions: Any) -> None:
        """Add `value` (not negative) to a counter."""
        if value < 0:
            raise ValueError(f"counter {name!r} cannot go down (got {value})")
        self._update("counter", name, value, 0, dimensions)

    def gauge(self, name: str, value: float, **dimensions: Any) -> None:
        """Set a gauge."""
        self._update("gauge", name, value, 0, dimensions)

    def observe(self, name: str, value: float, **dimensions: Any) -> None:
        """Add one observation to a summary (exported as `<name>_count` and `<name>_sum`)."""
        self._update("summary", name, value, 1, dimensions)

    @contextlib.contextmanager
    def timer(self, name: str, **dimensions: Any) -> Iterator[None]:
        """Observe the seconds the block takes (also when it raises)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - started, **dimensions)

    def declare(self, kind: Kind, name: str) -> None:
        """Fix a metric's kind before it is first recorded."""
        with self._lock:
            self._kinds.setdefault(metric_name(name), kind)

    def series(self) -> list[Series]:
        """A copy of every series, for a scrape."""
        with self._lock:
            return [Series(**vars(s)) for s in self._series.values()]

    # -- process workers ----------------------------------------------------------------------
    def drain(self) -> list[Series]:
        """What changed since the last drain: counters and summaries as increments, gauges as
        their value. Empty (and cheap) when the handler recorded nothing."""
        if not self._changed:
            return []
        with self._lock:
            out = []
            for key in self._changed:
                s = self._series[key]
                if s.kind == "gauge":
                    out.append(Series(**vars(s)))
                    continue
                value, count = self._drained.get(key, (0.0, 0))
                out.append(Series(s.kind, s.name, s.dimensions, s.value - value, s.count - count))
                self._drained[key] = (s.value, s.count)
            self._changed.clear()
            return out

    def merge(self, changes: list[Series]) -> None:
        """Add what a process worker drained."""
        for change in changes:
            dims = dict(change.dimensions)
            with contextlib.suppress(ValueError):  # a kind clash was refused in the worker
                self._update(change.kind, change.name, change.value, change.count, dims)
