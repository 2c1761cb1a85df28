"""The dashboard drawn with matplotlib: panels placed by `gridPos` on Grafana's dark theme, each
drawn as its type (time series, stat, bar gauge) with the values read from Prometheus."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator

from benchmarks.dashboard.load import PhaseRun
from benchmarks.dashboard.panels import PanelData, Window
from benchmarks.dashboard.prometheus import JOB
from benchmarks.dashboard.units import format_value

WIDTH_PX, DPI, ROW_PX, GAP_PX, MARGIN_PX = 1800, 100, 30, 8, 12
HEADER_PX, FOOTER_PX = 118, 34
CANVAS, PANEL, BORDER = "#111217", "#181b1f", "#2c3036"
TEXT, DIM, GRID = "#ccccdc", "#8e8ea0", "#2a2d33"
ANNOTATION = "#00d3ff"  # the dashboard's built-in annotation colour
NAMED = {
    "green": "#73BF69",
    "blue": "#5794F2",
    "orange": "#FF9830",
    "red": "#F2495C",
    "yellow": "#FADE2A",
    "purple": "#B877D9",
    "text": TEXT,
}
CLASSIC = [
    "#7EB26D",
    "#EAB839",
    "#6ED0E0",
    "#EF843C",
    "#E24D42",
    "#1F78C1",
    "#BA43A9",
    "#705DA0",
    "#508642",
    "#CCA300",
]
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
        ax.fill_between(
            when, lower, upper, color=color, linewidth=0, alpha=custom.get("fillOpacity", 0) / 100
        )
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
            ax.axvline(
                clock(run.started),
                color=ANNOTATION,
                alpha=0.45,
                linewidth=0.8,
                linestyle=(0, (4, 3)),
            )
        ax.annotate(
            run.phase.label,
            (clock(run.started), 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -2),
            textcoords="offset points",
            va="top",
            fontsize=7,
            color=ANNOTATION,
            alpha=0.8,
        )
    legend = c.fig.legend(
        lines,
        [s.name for s in data.series],
        loc="lower left",
        ncols=columns,
        frameon=False,
        fontsize=8,
        bbox_to_anchor=c.frac(x + 6, top + h - 2),
        handlelength=1.2,
        columnspacing=1.5,
        borderaxespad=0,
    )
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
    c.text(
        x + w / 2,
        top + h * 0.58,
        text,
        color=color,
        fontsize=size_px * 72 / DPI,
        ha="center",
        va="center",
        weight="bold",
    )


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
    c.text(
        WIDTH_PX - MARGIN_PX,
        18,
        f"{start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S} {end:%Z}",
        fontsize=11,
        ha="right",
    )
    pickers = [
        f"{v.get('label', v['name'])}:  {'All' if v.get('includeAll') else JOB}"
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    c.text(
        MARGIN_PX, 46, "      ".join(["Data source:  Prometheus", *pickers]), fontsize=10, color=DIM
    )
    c.text(MARGIN_PX, 70, header, fontsize=9.5, linespacing=1.5)
    data_of = {id(d.panel): d for d in panels}
    for panel in dashboard["panels"]:
        x, top, w, h = box = c.panel_box(panel["gridPos"])
        if panel["type"] == "row":
            c.text(x, top + 6, f"\u2304  {panel['title']}", fontsize=12.5, weight="bold")
            continue
        left, upper = c.frac(x, top)
        # Behind the panel's axes (zorder 0), which are added after it.
        c.fig.add_artist(
            Rectangle(
                (left, upper - h / c.height),
                w / WIDTH_PX,
                h / c.height,
                transform=c.fig.transFigure,
                facecolor=PANEL,
                edgecolor=BORDER,
                linewidth=1,
                zorder=-1,
            )
        )
        c.text(x + 9, top + 8, panel["title"], fontsize=10, weight="bold")
        data = data_of[id(panel)]
        if data.empty:
            c.text(
                x + w / 2,
                top + h / 2 + 8,
                "No data",
                fontsize=14,
                color=DIM,
                ha="center",
                va="center",
            )
        elif panel["type"] == "timeseries":
            draw_timeseries(c, box, data, window, runs)
        elif panel["type"] == "stat":
            draw_stat(c, box, data, window)
        elif panel["type"] == "bargauge":
            draw_bargauge(c, box, data)
    c.text(
        MARGIN_PX,
        c.height - FOOTER_PX + 12,
        "Drawn by benchmarks/dashboard/ from the dashboard's own JSON "
        "(docker/grafana/dashboards/scriptserve.json) and the answers of a real Prometheus, "
        "scraping a real scriptserve server every second, to its queries: not a Grafana "
        "screenshot. Dashed lines mark the load's phases.",
        fontsize=8.5,
        color=DIM,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    c.fig.savefig(out, dpi=DPI, facecolor=CANVAS)
    plt.close(c.fig)
