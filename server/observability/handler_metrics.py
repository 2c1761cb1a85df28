"""Handler metrics on /metrics: each model version's `context.metrics` (handlers/metrics.py)
read at scrape time, and TorchServe's metrics.yaml declarations.

A series is exported under the handler's metric name with the labels `model` and `version`
and its own dimensions. Two models that use one name with different kinds cannot share a
Prometheus family: the first kind seen at a scrape wins, and the other model's series are left
out (and logged once), so one handler cannot break the scrape for the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from scriptserve.handlers.metrics import HandlerMetrics, Kind

log = logging.getLogger("scriptserve.metrics")

Declaration = tuple[str, str, str, tuple[str, ...]]
"""(kind: counter, gauge or histogram; name; unit; dimension names)."""

_TYPES: dict[Kind, str] = {"counter": "counter", "gauge": "gauge", "summary": "summary"}


def read_metrics_config(path: Path) -> tuple[Declaration, ...]:
    """The `model_metrics` of a TorchServe metrics.yaml; ValueError naming what is wrong."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"metrics_config {path}: {exc}") from None
    metrics = (doc or {}).get("model_metrics") or {}
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics_config {path}: model_metrics must map kinds to lists")
    found: list[Declaration] = []
    for kind, entries in metrics.items():
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(
                f"metrics_config {path}: model_metrics.{kind}: use counter, gauge or histogram"
            )
        for entry in entries or ():
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ValueError(f"metrics_config {path}: each {kind} entry needs a name")
            dims = tuple(str(d) for d in entry.get("dimensions") or ())
            found.append((kind, entry["name"], str(entry.get("unit", "")), dims))
    return tuple(found)


class HandlerMetricsCollector(Collector):
    """Every model version's handler metrics, from `source` ((model, version, store) each)."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, str, HandlerMetrics]]]) -> None:
        self._source = source
        self._clashes: set[tuple[str, str]] = set()

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, version, store in self._source():
            for series in store.series():
                family = families.get(series.name)
                if family is None:
                    family = families[series.name] = Metric(
                        series.name, f"handler metric {series.name}", _TYPES[series.kind]
                    )
                elif family.type != _TYPES[series.kind]:
                    self._clash(series.name, model)
                    continue
                labels: dict[str, Any] = {"model": model, "version": version}
                labels.update(series.dimensions)
                if series.kind == "counter":
                    family.add_sample(series.name + "_total", labels, series.value)
                elif series.kind == "gauge":
                    family.add_sample(series.name, labels, series.value)
                else:
                    family.add_sample(series.name + "_count", labels, series.count)
                    family.add_sample(series.name + "_sum", labels, series.value)
        yield from families.values()

    def _clash(self, name: str, model: str) -> None:
        if (name, model) not in self._clashes:
            self._clashes.add((name, model))
            log.warning(
                "model=%s handler metric %s has another kind in another model; its series are "
                "left out of /metrics: give it another name",
                model,
                name,
            )
