"""The Grafana dashboard (docker/grafana/dashboards/scriptserve.json) over a benchmark run, drawn
as a PNG for docs/observability.md without Grafana:

    python -m benchmarks.dashboard [--seconds 90] [--out docs/images/dashboard.png]

Serves scenario A's MLP (benchmarks/models.py) with a real `python -m scriptserve serve`, has a
real Prometheus (Debian's `prometheus`) scrape its /metrics every second, and loads it with wrk
in phases: idle, 1, 8 connections, light load mixed with bad requests (404s and 400s sent with
httpx), then 32 connections. Every panel's queries are then run against Prometheus as Grafana
would run them (its variables substituted; range queries for time series, instant queries at the
end of the load for stats and bar gauges) and the dashboard is drawn from its own JSON: panels
placed by `gridPos`, series named by `legendFormat`, values in the panel's unit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator

from benchmarks import models
from benchmarks.loadgen import LoadResult, run_wrk, wrk_path
from benchmarks.servers import REPO, free_port, scriptserve

DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "scriptserve.json"
JOB = "scriptserve"
SCRAPE_S = 1
STEP_S = 2
# Grafana's $__rate_interval: max(4 x scrape interval, query step + scrape interval).
RATE_INTERVAL = f"{max(4 * SCRAPE_S, STEP_S + SCRAPE_S)}s"


# --- Prometheus -----------------------------------------------------------------------------


class QueryError(Exception):
    """Prometheus refused a query (its message)."""


class Prometheus:
    """Debian's prometheus in `workdir`, scraping `target` (host:port) every second under the job
    `JOB`, on a free loopback port; a context manager that returns once the target is scraped."""

    def __init__(self, binary: str, workdir: Path, target: str) -> None:
        self.argv = [
            binary, f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}", "--log.level=warn",
        ]  # fmt: skip
        self.workdir = workdir
        self.target = target
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.queries = 0
        self._client = httpx.Client(timeout=10)

    def __enter__(self) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        scrape = {"job_name": JOB, "metrics_path": "/metrics",
                  "static_configs": [{"targets": [self.target]}]}  # fmt: skip
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s"}, "scrape_configs": [scrape]}
        # JSON is YAML, so no YAML writer is needed.
        (self.workdir / "prometheus.yml").write_text(json.dumps(config, indent=1))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [*self.argv, f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        try:
            self._wait(lambda: self._client.get(f"{self.url}/-/ready").status_code == 200, 60)
            self._wait(lambda: bool(self.query(f'up{{job="{JOB}"}} == 1', time.time())), 30)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log()}")
            try:
                if done():
                    return
            except (httpx.TransportError, QueryError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready within {timeout_s:g} s:\n{self.log()}")

    def wait_for_scrape_after(self, at: float) -> None:
        """Return once a scrape taken after `at` is stored: queries at `at` then see it all."""
        expr = f'max(timestamp(up{{job="{JOB}"}}))'
        self._wait(lambda: any(float(r["value"][1]) >= at for r in self.query(expr, time.time())),
                   10 * SCRAPE_S)  # fmt: skip

    def _api(self, path: str, params: Mapping[str, str | float]) -> Any:
        self.queries += 1
        answer = self._client.get(f"{self.url}/api/v1/{path}", params=dict(params)).json()
        if answer.get("status") != "success":
            raise QueryError(str(answer.get("error", answer)))
        return answer["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        data = self._api("query", {"query": expr, "time": at})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(
        self, expr: str, start: float, end: float, step: float = STEP_S
    ) -> list[dict[str, Any]]:
        data = self._api("query_range", {"query": expr, "start": start, "end": end,
                                         "step": step})  # fmt: skip
        return list(data["result"])

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        self._client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(path).exists():
        raise SystemExit("prometheus is not installed: apt-get install -y prometheus")
    return path


# --- Load -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    name: str
    label: str
    """Its short name on the graphs."""
    seconds: int
    connections: int
    """wrk's connections on /predictions/mlp; 0 for none."""
    bad: bool = False
    """Bad requests too, from httpx."""


@dataclass
class PhaseRun:
    phase: Phase
    started: float
    ended: float = 0.0
    load: LoadResult | None = None
    bad: dict[int, int] = field(default_factory=dict)
    """Status -> bad requests answered with it."""


BAD = 4
"""wrk's connections during the bad requests."""
BAD_PAUSE_S = 0.08
"""Between rounds of the four bad requests: about 40 a second, a few % of the light load."""


def plan(seconds: float) -> list[Phase]:
    """A ramp of 1, 8 and 32 connections with bad requests before the last step, `seconds` in
    all after a short idle start (so every graph starts from the idle server)."""

    def share(fraction: float) -> int:
        return max(3, round(seconds * fraction))

    return [
        Phase("idle", "idle", 4, 0),
        Phase("1 connection", "1 conn.", share(0.2), 1),
        Phase("8 connections", "8 conn.", share(0.25), 8),
        Phase(f"bad requests + {BAD} connections", "bad requests", share(0.2), BAD, bad=True),
        Phase("32 connections", "32 conn.", share(0.35), 32),
    ]


def send_bad_requests(
    base_url: str, good_body: bytes, until: Callable[[], bool], counts: dict[int, int]
) -> None:
    """Unknown models (404) and malformed bodies (400) over both REST APIs while `until()` is
    false, paced so that they are a small share of the traffic."""
    requests = [
        ("/predictions/no-such-model", good_body),
        ("/v2/models/no-such-model/infer", b'{"inputs": []}'),
        ("/predictions/mlp", b"{not json"),
        ("/predictions/mlp", b"[1, 2, 3]"),  # the model takes rows of 512
    ]
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=10) as client:
        while not until():
            for path, body in requests:
                status = client.post(path, content=body).status_code
                counts[status] = counts.get(status, 0) + 1
            time.sleep(BAD_PAUSE_S)


def drive(base_url: str, body: Path, phases: Sequence[Phase]) -> list[PhaseRun]:
    runs = []
    url = f"{base_url}/predictions/mlp"
    for phase in phases:
        run = PhaseRun(phase, started=time.time())
        load_phase = partial(run_wrk, url, connections=phase.connections, seconds=phase.seconds,
                             threads=2, body=body)  # fmt: skip
        if phase.bad:
            with ThreadPoolExecutor(1) as pool:
                load = pool.submit(load_phase)
                send_bad_requests(base_url, body.read_bytes(), load.done, run.bad)
                run.load = load.result()
        elif phase.connections:
            run.load = load_phase()
        else:
            time.sleep(phase.seconds)  # the idle server, as Prometheus sees it
        run.ended = time.time()
        runs.append(run)
        print(describe(run), flush=True)
    return runs


def describe(run: PhaseRun) -> str:
    line = f"phase {run.phase.name:<34} {run.ended - run.started:5.1f} s"
    if run.load is not None:
        r = run.load
        line += f": {r.rps:7.0f} req/s, p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms"
        line += f", {r.errors} wrk errors"
    if run.bad:
        line += "; bad requests " + ", ".join(f"{n} x {s}" for s, n in sorted(run.bad.items()))
    return line


# --- Queries --------------------------------------------------------------------------------


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
                    data.series.append(Series(series_name(legend, result["metric"]), s.times,
                                              s.values))  # fmt: skip
            if kind in ("stat", "bargauge"):
                values = [(series_name(legend, r["metric"]), float(r["value"][1]))
                          for r in prom.query(expr, window.end)]  # fmt: skip
                if target.get("format") == "heatmap":
                    values = deaccumulate(values)
                data.values += values
        except QueryError as exc:
            data.missing.append(f"{target.get('refId', '?')}: query failed: {exc}")
            continue
        if len(found) == before:
            data.missing.append(f"{target.get('refId', '?')} {legend or expr[:60]}".strip())
    return data


# --- Units ----------------------------------------------------------------------------------


def _number(value: float, decimals: int | None) -> str:
    if decimals is not None:
        return f"{value:.{decimals}f}"
    size = abs(value)
    text = f"{value:.{0 if size >= 100 else 1 if size >= 10 else 2}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scaled(value: float, base: float, names: Sequence[str], decimals: int | None) -> str:
    step = 0
    while abs(value) >= base and step < len(names) - 1:
        value, step = value / base, step + 1
    return f"{_number(value, decimals)}{names[step]}"


def format_value(value: float, unit: str, decimals: int | None = None) -> str:
    """`value` as Grafana shows it in `unit` (the units this dashboard uses)."""
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{_number(value * 100, decimals)}%"
    if unit == "s":
        size = abs(value)
        scale, name = (
            (1, " s") if size >= 1 or not size else (1e3, " ms") if size >= 1e-3 else (1e6, " µs")
        )
        return f"{_number(value * scale, decimals)}{name}"
    if unit == "bytes":
        return _scaled(value, 1024, (" B", " KiB", " MiB", " GiB", " TiB"), decimals)
    short = _scaled(value, 1000, ("", " K", " Mil", " Bil"), decimals)
    return f"{short} req/s" if unit == "reqps" else short


# --- Drawing --------------------------------------------------------------------------------

WIDTH_PX, DPI, ROW_PX, GAP_PX, MARGIN_PX = 1800, 100, 30, 8, 12
HEADER_PX, FOOTER_PX = 118, 34
CANVAS, PANEL, BORDER = "#111217", "#181b1f", "#2c3036"
TEXT, DIM, GRID = "#ccccdc", "#8e8ea0", "#2a2d33"
ANNOTATION = "#00d3ff"  # the dashboard's built-in annotation colour
NAMED = {"green": "#73BF69", "blue": "#5794F2", "orange": "#FF9830", "red": "#F2495C",
         "yellow": "#FADE2A", "purple": "#B877D9", "text": TEXT}  # fmt: skip
CLASSIC = ["#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9",
           "#705DA0", "#508642", "#CCA300"]  # fmt: skip
"""Grafana's palette-classic, in its order."""


class Canvas:
    """The figure in pixels from the top left, as Grafana lays panels out."""

    def __init__(self, grid_rows: int) -> None:
        self.height = HEADER_PX + grid_rows * ROW_PX + FOOTER_PX
        self.fig: Figure = plt.figure(figsize=(WIDTH_PX / DPI, self.height / DPI), dpi=DPI)
        self.fig.patch.set_facecolor(CANVAS)
        self.column = (WIDTH_PX - 2 * MARGIN_PX) / 24

    def frac(self, x: float, y: float) -> tuple[float, float]:
        return x / WIDTH_PX, 1 - y / self.height

    def axes(self, x: float, top: float, w: float, h: float) -> Axes:
        left, upper = self.frac(x, top)
        return self.fig.add_axes((left, upper - h / self.height, w / WIDTH_PX, h / self.height))

    def text(self, x: float, y: float, s: str, **style: Any) -> None:
        self.fig.text(*self.frac(x, y), s, **{"color": TEXT, "va": "top", **style})

    def panel_box(self, grid: Mapping[str, int]) -> tuple[float, float, float, float]:
        x = MARGIN_PX + grid["x"] * self.column + GAP_PX / 2
        top = HEADER_PX + grid["y"] * ROW_PX + GAP_PX / 2
        return x, top, grid["w"] * self.column - GAP_PX, grid["h"] * ROW_PX - GAP_PX


def style_axes(ax: Axes) -> None:
    ax.set_facecolor(PANEL)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(colors=DIM, labelsize=8, length=0)
    ax.grid(color=GRID, linewidth=0.7)
    ax.set_axisbelow(True)


def unit_formatter(unit: str) -> FuncFormatter:
    return FuncFormatter(lambda v, _: format_value(v, unit))


def threshold_color(defaults: Mapping[str, Any], value: float) -> str:
    color = "green"
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step["value"] is None or (not math.isnan(value) and value >= step["value"]):
            color = step["color"]
    return NAMED.get(color, color)


def clock(t: float) -> float:
    """A Unix time as matplotlib's date number for the local clock, as Grafana shows time."""
    return float(mdates.date2num(dt.datetime.fromtimestamp(t)))  # type: ignore[no-untyped-call]


def draw_timeseries(
    c: Canvas, box: Sequence[float], data: PanelData, window: Window, runs: Sequence[PhaseRun]
) -> None:
    x, top, w, h = box
    defaults = data.defaults
    custom, unit = defaults.get("custom", {}), defaults.get("unit", "short")
    columns = max(1, int((w - 16) // 190))
    legend_px = 17 * math.ceil(len(data.series) / columns) + 4
    ax = c.axes(x + 62, top + 30, w - 74, h - 30 - 22 - legend_px)
    style_axes(ax)
    stacked = custom.get("stacking", {}).get("mode", "none") == "normal"
    base = np.zeros(len(data.series[0].times))
    lines = []
    for i, s in enumerate(data.series):
        when = [clock(t) for t in s.times]
        lower = base if stacked else np.zeros_like(s.values)
        upper = lower + s.values
        color = CLASSIC[i % len(CLASSIC)]
        lines += ax.plot(when, upper, color=color, linewidth=custom.get("lineWidth", 1) * 1.2)
        ax.fill_between(when, lower, upper, color=color, linewidth=0,
                        alpha=custom.get("fillOpacity", 0) / 100)  # fmt: skip
        if stacked:
            base = np.where(np.isnan(s.values), base, upper)
    if "min" in defaults:
        ax.set_ylim(bottom=defaults["min"])
    if not np.nanmax([np.nanmax(np.abs(s.values), initial=0) for s in data.series]):
        ax.set_ylim(0, 1)  # all zero: Grafana's axis still spans 0 to 1
    ax.set_xlim(clock(window.start), clock(window.end))
    ax.yaxis.set_major_formatter(unit_formatter(unit))
    ax.yaxis.set_major_locator(MaxNLocator(5, integer=defaults.get("decimals") == 0))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))  # type: ignore[no-untyped-call]
    # Round clock times (every 10, 15, 20 or 30 s), as Grafana picks them.
    ticks = mdates.AutoDateLocator(minticks=3, maxticks=8 if w > 700 else 5)  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_locator(ticks)
    # The phases, as Grafana draws annotations: a dashed line where each starts.
    for run in runs:
        if run is not runs[0]:
            ax.axvline(clock(run.started), color=ANNOTATION, alpha=0.45, linewidth=0.8,
                       linestyle=(0, (4, 3)))  # fmt: skip
        ax.annotate(run.phase.label, (clock(run.started), 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -2), textcoords="offset points", va="top", fontsize=7,
                    color=ANNOTATION, alpha=0.8)  # fmt: skip
    legend = c.fig.legend(lines, [s.name for s in data.series], loc="lower left",
                          ncols=columns, frameon=False, fontsize=8,
                          bbox_to_anchor=c.frac(x + 6, top + h - 2), handlelength=1.2,
                          columnspacing=1.5, borderaxespad=0)  # fmt: skip
    for text in legend.get_texts():
        text.set_color(TEXT)


def draw_stat(c: Canvas, box: Sequence[float], data: PanelData, window: Window) -> None:
    x, top, w, h = box
    defaults = data.defaults
    value = data.values[0][1]
    color = threshold_color(defaults, value)
    if data.series and data.panel.get("options", {}).get("graphMode") == "area":
        spark = c.axes(x + 1, top + h * 0.55, w - 2, h * 0.45 - 1)
        spark.set_axis_off()
        s = data.series[0]
        spark.fill_between(s.times, 0, s.values, color=color, alpha=0.18, linewidth=0)
        spark.plot(s.times, s.values, color=color, alpha=0.7, linewidth=1)
        spark.set_xlim(window.start, window.end)
        spark.set_ylim(bottom=0)
    text = format_value(value, defaults.get("unit", "short"), defaults.get("decimals"))
    size_px = min(h * 0.34, (w - 20) / max(1, len(text)) * 1.6)
    c.text(x + w / 2, top + h * 0.58, text, color=color, fontsize=size_px * 72 / DPI,
           ha="center", va="center", weight="bold")  # fmt: skip


def draw_bargauge(c: Canvas, box: Sequence[float], data: PanelData) -> None:
    x, top, w, h = box
    defaults = data.defaults
    color = NAMED.get(defaults.get("color", {}).get("fixedColor", "blue"), NAMED["blue"])
    names, values = [n for n, _ in data.values], [v for _, v in data.values]
    vertical = data.panel.get("options", {}).get("orientation") == "vertical"
    ax = (
        c.axes(x + 10, top + 48, w - 20, h - 48 - 20)
        if vertical
        else c.axes(x + 60, top + 32, w - 74, h - 40)
    )
    ax.set_facecolor(PANEL)
    ax.set_axis_off()
    peak = max(values) or 1.0
    places = np.arange(len(values))
    bar = ax.bar if vertical else ax.barh
    bar(places, [peak] * len(values), 0.8, color=GRID)  # showUnfilled
    bar(places, values, 0.8, color=color)
    for i, (n, v) in enumerate(zip(names, values, strict=True)):
        shown = format_value(v, defaults.get("unit", "short"), defaults.get("decimals"))
        if vertical:
            ax.text(i, peak * 1.02, shown, color=color, ha="center", va="bottom", fontsize=8.5)
            ax.text(i, -peak * 0.03, n, color=TEXT, ha="center", va="top", fontsize=8)
        else:
            ax.text(peak * 1.01, i, shown, color=color, va="center", fontsize=8.5)
            ax.text(-peak * 0.02, i, n, color=TEXT, ha="right", va="center", fontsize=8)
    if vertical:
        ax.set_xlim(-0.5, len(values) - 0.5)
    else:
        ax.set_ylim(len(values) - 0.5, -0.5)


def draw(
    dashboard: Mapping[str, Any],
    panels: Sequence[PanelData],
    window: Window,
    runs: Sequence[PhaseRun],
    header: str,
    out: Path,
) -> None:
    c = Canvas(max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"]))
    start, end = (dt.datetime.fromtimestamp(t).astimezone() for t in (window.start, window.end))
    c.text(MARGIN_PX, 14, f"Dashboards / {dashboard['title']}", fontsize=17, weight="bold")
    c.text(WIDTH_PX - MARGIN_PX, 18, f"{start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S} {end:%Z}",
           fontsize=11, ha="right")  # fmt: skip
    pickers = [f"{v.get('label', v['name'])}:  {'All' if v.get('includeAll') else JOB}"
               for v in dashboard["templating"]["list"] if v["type"] == "query"]  # fmt: skip
    c.text(MARGIN_PX, 46, "      ".join(["Data source:  Prometheus", *pickers]), fontsize=10,
           color=DIM)  # fmt: skip
    c.text(MARGIN_PX, 70, header, fontsize=9.5, linespacing=1.5)
    data_of = {id(d.panel): d for d in panels}
    for panel in dashboard["panels"]:
        x, top, w, h = box = c.panel_box(panel["gridPos"])
        if panel["type"] == "row":
            c.text(x, top + 6, f"\u2304  {panel['title']}", fontsize=12.5, weight="bold")
            continue
        left, upper = c.frac(x, top)
        # Behind the panel's axes (zorder 0), which are added after it.
        c.fig.add_artist(Rectangle((left, upper - h / c.height), w / WIDTH_PX, h / c.height,
                                   transform=c.fig.transFigure, facecolor=PANEL,
                                   edgecolor=BORDER, linewidth=1, zorder=-1))  # fmt: skip
        c.text(x + 9, top + 8, panel["title"], fontsize=10, weight="bold")
        data = data_of[id(panel)]
        if data.empty:
            c.text(x + w / 2, top + h / 2 + 8, "No data", fontsize=14, color=DIM, ha="center",
                   va="center")  # fmt: skip
        elif panel["type"] == "timeseries":
            draw_timeseries(c, box, data, window, runs)
        elif panel["type"] == "stat":
            draw_stat(c, box, data, window)
        elif panel["type"] == "bargauge":
            draw_bargauge(c, box, data)
    c.text(MARGIN_PX, c.height - FOOTER_PX + 12,
           "Drawn by benchmarks/dashboard.py from the dashboard's own JSON "
           "(docker/grafana/dashboards/scriptserve.json) and the answers of a real Prometheus, "
           "scraping a real scriptserve server every second, to its queries: not a Grafana "
           "screenshot. Dashed lines mark the load's phases.", fontsize=8.5, color=DIM)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    c.fig.savefig(out, dpi=DPI, facecolor=CANVAS)
    plt.close(c.fig)


# --- Main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dashboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--seconds", type=float, default=90.0, help="length of the load (about)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "dashboard.png")
    return p.parse_args(argv)


def load_summary(runs: Sequence[PhaseRun], workers: int) -> str:
    phases = ", ".join(f"{r.phase.name} {r.ended - r.started:.0f} s" for r in runs)
    return (
        f"Load: wrk on /predictions/mlp (scenario A's MLP, one row of 512 floats per request), "
        f"closed loop: {phases}. Bad requests: unknown models (404), malformed bodies (400).\n"
        f"Server: python -m scriptserve serve, {workers} thread workers, batches of up to 32, no "
        f"delay, on {workers} CPUs shared with wrk and Prometheus. Prometheus scrapes /metrics "
        f"every {SCRAPE_S} s; $__rate_interval = {RATE_INTERVAL}, step {STEP_S} s; stats and the "
        f"bar gauge as at the end of the load."
    )


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the `with`s, which stop the server and Prometheus


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    wrk_path()
    binary = prometheus_binary()
    dashboard = json.loads(DASHBOARD.read_text())
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="scriptserve-dashboard-") as tmp:
        store = Path(tmp) / "store"
        model = models.build("mlp", Path(tmp) / "work", store)
        server = scriptserve("scriptserve", store, "mlp", workers=workers, intra_op_threads=1,
                             max_batch_size=32)  # fmt: skip
        with server:
            assert server.metrics_url is not None
            target = urllib.parse.urlsplit(server.metrics_url).netloc
            with Prometheus(binary, Path(tmp) / "prometheus", target) as prom:
                print(f"server {server.url}, {workers} thread workers; Prometheus {prom.url} "
                      f"scraping {target} every {SCRAPE_S} s")  # fmt: skip
                runs = drive(server.url, model.body, plan(args.seconds))
                # A scrape before the load stopped, so that stats and the graphs' last points
                # show the server under load rather than the instant after.
                start, end = runs[0].started, runs[-1].ended - SCRAPE_S
                prom.wait_for_scrape_after(runs[-1].ended)
                counted = sum(float(r["value"][1]) for r in prom.query(
                    f'sum(scriptserve_requests_total{{job="{JOB}"}})', time.time()))  # fmt: skip
                window = Window(start, end, variables(dashboard, start, end))
                prom.queries = 0
                panels = [read_panel(prom, p, window)
                          for p in dashboard["panels"] if p["type"] != "row"]  # fmt: skip
                queries = prom.queries
    sent = sum((r.load.requests if r.load else 0) + sum(r.bad.values()) for r in runs)
    print(f"requests: wrk and httpx had {sent} answered, the server counted {counted:.0f}")
    draw(dashboard, panels, window, runs, load_summary(runs, workers), args.out)
    print(f"dashboard {dashboard['title']!r}: {len(panels)} panels, {queries} queries over "
          f"{end - start:.0f} s; variables {window.variables}")  # fmt: skip
    for data in panels:
        if data.panel["type"] == "stat" and data.values:
            unit, decimals = data.defaults.get("unit", "short"), data.defaults.get("decimals")
            print(
                f"stat {data.panel['title']!r}: {format_value(data.values[0][1], unit, decimals)}"
            )
        for missing in data.missing:
            state = "No data" if data.empty else "drawn without it"
            print(f"no data: {data.panel['title']!r} target {missing} ({state})")
    print(f"picture: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
