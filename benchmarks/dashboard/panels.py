"""The dashboard's panels read as Grafana reads them: its variables substituted, each target's
query run against Prometheus over the window (time series) or at its end (stats, bar gauges)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.dashboard.prometheus import JOB, RATE_INTERVAL, STEP_S, Prometheus, QueryError
from benchmarks.servers import REPO

DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "scriptserve.json"


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    variables: dict[str, str]


@dataclass(frozen=True)
class Series:
    name: str
    times: np.ndarray
    values: np.ndarray


@dataclass
class PanelData:
    panel: Mapping[str, Any]
    series: list[Series] = field(default_factory=list)
    """Over the window (time series, and a stat's sparkline)."""
    values: list[tuple[str, float]] = field(default_factory=list)
    """At the window's end (stat, bar gauge)."""
    missing: list[str] = field(default_factory=list)
    """Targets that returned no data, or an error."""

    @property
    def defaults(self) -> Mapping[str, Any]:
        """The panel's field defaults: unit, decimals, thresholds, min, line style."""
        return dict(self.panel.get("fieldConfig", {}).get("defaults", {}))

    @property
    def empty(self) -> bool:
        """What Grafana shows as "No data": a time series without series, a stat or bar gauge
        without a value."""
        return not (self.series if self.panel["type"] == "timeseries" else self.values)


_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def variables(dashboard: Mapping[str, Any], start: float, end: float) -> dict[str, str]:
    """What Grafana puts in place of each variable: "All" where a variable allows it, else the
    one job there is; the rate interval for a 1 s scrape; the range as the run's length."""
    found = {"__rate_interval": RATE_INTERVAL, "__range": f"{math.ceil(end - start)}s"}
    for v in dashboard.get("templating", {}).get("list", []):
        if v["type"] == "query":
            found[v["name"]] = v.get("allValue", ".*") if v.get("includeAll") else JOB
    return found


def substitute(expr: str, values: Mapping[str, str]) -> str:
    return _VARIABLE.sub(lambda m: values.get(m.group(1) or m.group(2), m.group(0)), expr)


def series_name(legend: str, labels: Mapping[str, str]) -> str:
    if legend:
        return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), legend).strip()
    shown = [f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__"]
    return labels.get("__name__", "") + ("{" + ", ".join(shown) + "}" if shown else "")


def on_grid(points: Sequence[Sequence[Any]], window: Window) -> Series:
    """A range result on the window's step grid, NaN where Prometheus had no point (a gap)."""
    times = np.arange(window.start, window.end + 1e-6, STEP_S)
    values = np.full(len(times), np.nan)
    for t, v in points:
        i = round((float(t) - window.start) / STEP_S)
        if 0 <= i < len(values):
            values[i] = float(v)
    return Series("", times, values)


def deaccumulate(values: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """Grafana's `format: heatmap`: cumulative `le` buckets, sorted, as counts per bucket."""
    ordered = sorted(values, key=lambda nv: float(nv[0].replace("+Inf", "inf")))
    counts, below = [], 0.0
    for name, total in ordered:
        counts.append((name, max(0.0, total - below)))
        below = total
    return counts


def read_panel(prom: Prometheus, panel: Mapping[str, Any], window: Window) -> PanelData:
    data = PanelData(panel)
    kind = panel["type"]
    for target in panel.get("targets", []):
        expr = substitute(target["expr"], window.variables)
        legend = target.get("legendFormat", "")
        found = data.series if kind == "timeseries" else data.values
        before = len(found)
        try:
            if kind in ("timeseries", "stat"):
                for result in prom.query_range(expr, window.start, window.end):
                    s = on_grid(result["values"], window)
                    data.series.append(
                        Series(series_name(legend, result["metric"]), s.times, s.values)
                    )
            if kind in ("stat", "bargauge"):
                values = [
                    (series_name(legend, r["metric"]), float(r["value"][1]))
                    for r in prom.query(expr, window.end)
                ]
                if target.get("format") == "heatmap":
                    values = deaccumulate(values)
                data.values += values
        except QueryError as exc:
            data.missing.append(f"{target.get('refId', '?')}: query failed: {exc}")
            continue
        if len(found) == before:
            data.missing.append(f"{target.get('refId', '?')} {legend or expr[:60]}".strip())
    return data
