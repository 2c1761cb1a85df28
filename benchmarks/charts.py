"""PNG charts of the benchmark results in benchmarks/results/, for docs/observability.md.

    python -m benchmarks.charts                     # the newest full runs -> docs/images/
    python -m benchmarks.charts --http results/http_load-2026-11-21T1953.json

- `bench-throughput.png`: requests/s of each server of scenarios A and B (http_load), at 32
  connections and at 1: scriptserve with batching on and off against the FastAPI baselines.
- `bench-latency.png`: p50 and p99 of the same runs.
- `bench-grpc.png`: scenario A's model over REST and gRPC on one scriptserve (grpc_load).

Bars are the median over a run's rounds and the whiskers its slowest and fastest round. For
each scenario the newest full run that has it is used: a file under the name the benchmark
gives by default (`http_load-<date>T<time>.json`), so neither a `-quick` run nor one written
with `--output` for a comparison (before/after a change). Each chart names its files, their
dates and the machine (CPUs, load average): other work on the 2-core build machine shows up in
the figures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

RESULTS = Path(__file__).resolve().parent / "results"
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"

# What each contender of benchmarks/scenarios.py is called on a chart, in the order drawn.
LABELS = {
    "bare_fastapi": "bare FastAPI\n(baseline)",
    "per_request_async": "per-request\nFastAPI async\n(baseline)",
    "per_request_threadpool": "per-request\nFastAPI def\n(baseline)",
    "batching_on": "scriptserve\nbatching on",
    "batching_off": "scriptserve\nbatching off",
}
GRPC_LABELS = {
    "rest_json": "REST\nJSON",
    "rest_oip": "REST\nOIP binary",
    "grpc_32x1": "gRPC h2load\n32 x 1",
    "grpc_1x32": "gRPC h2load\n1 x 32",
    "grpc_cpp_unary": "gRPC C++\nunary",
    "grpc_cpp_stream": "gRPC C++\nstream",
    "grpc_cpp_stream_1x32": "gRPC C++\nstream 1 x 32",
}
SCRIPTSERVE_COLOR, SCRIPTSERVE_OFF_COLOR, BASELINE_COLOR = "#1f6fd1", "#7fb2ee", "#9a9a9a"


@dataclass(frozen=True)
class Result:
    """One results file, read."""

    path: Path
    document: dict[str, Any]

    @property
    def started(self) -> str:
        return str(self.document.get("started", ""))

    def note(self) -> str:
        """Where and when: the file, its date, the machine, and the rounds."""
        host = self.document.get("host", {})
        options = self.document.get("options", {})
        parts = [f"{self.path.name}, {self.started[:16].replace('T', ' ')}"]
        if host:
            load = host.get("load_average_before", [None])[0]
            parts.append(
                f"{host.get('cpus', '?')} CPUs, load average {load:.1f} at start"
                if load is not None
                else f"{host.get('cpus', '?')} CPUs"
            )
        if options:
            rounds, seconds = options.get("repeats", "?"), options.get("seconds", "?")
            parts.append(
                f"{rounds} rounds of {seconds:g} s"
                if isinstance(seconds, float)
                else f"{rounds} rounds of {seconds} s"
            )
        if "note" in self.document:
            parts.append(str(self.document["note"]))
        return "; ".join(parts)


def read(path: Path) -> Result:
    return Result(path, json.loads(path.read_text()))


def newest(kind: str, scenario: str | None = None) -> Result | None:
    """The newest full run of benchmark `kind` (that has `scenario`), by its start time."""
    found = []
    default_name = re.compile(rf"{kind}-\d{{4}}-\d\d-\d\dT\d{{4}}\.json")
    for path in RESULTS.glob(f"{kind}-*.json"):
        if not default_name.fullmatch(path.name):
            continue
        result = read(path)
        if result.document.get("benchmark") != kind:
            continue
        if scenario is not None and scenario not in result.document.get("scenarios", {}):
            continue
        found.append(result)
    return max(found, key=lambda r: r.started, default=None)


@dataclass(frozen=True)
class Bar:
    label: str
    color: str
    median: float
    low: float
    high: float


def spread(runs: Sequence[Mapping[str, Any]], field: str) -> tuple[float, float, float]:
    values = [float(r[field]) for r in runs]
    return statistics.median(values), min(values), max(values)


def color_of(key: str) -> str:
    if key == "batching_on":
        return SCRIPTSERVE_COLOR
    if key == "batching_off":
        return SCRIPTSERVE_OFF_COLOR
    return BASELINE_COLOR


def draw_bars(ax: Axes, bars: Sequence[Bar], unit: str, fmt: str = "{:.0f}") -> None:
    xs = range(len(bars))
    ax.bar(
        xs,
        [b.median for b in bars],
        color=[b.color for b in bars],
        yerr=[[b.median - b.low for b in bars], [b.high - b.median for b in bars]],
        capsize=3,
        ecolor="#333333",
    )
    for x, b in zip(xs, bars, strict=True):
        ax.annotate(
            fmt.format(b.median),
            (x, b.high),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(list(xs), [b.label for b in bars], fontsize=7.5)
    ax.set_ylabel(unit)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def scenario_runs(result: Result, key: str) -> dict[str, Any]:
    return dict(result.document["scenarios"][key])


def ordered(runs: Mapping[str, Any]) -> list[str]:
    return [k for k in LABELS if k in runs] + [k for k in runs if k not in LABELS]


def throughput_chart(http: Mapping[str, Result], out: Path) -> None:
    fig, axes = plt.subplots(len(http), 2, figsize=(11, 3.6 * len(http)), squeeze=False)
    for row, (key, result) in enumerate(sorted(http.items())):
        scenario = scenario_runs(result, key)
        for col, conns in enumerate(("32", "1")):
            keys = [k for k in ordered(scenario["runs"]) if conns in scenario["runs"][k]]
            bars = [
                Bar(LABELS.get(k, k), color_of(k), *spread(scenario["runs"][k][conns], "rps"))
                for k in keys
            ]
            ax = axes[row][col]
            draw_bars(ax, bars, "requests/s")
            ax.set_title(f"Scenario {key}, {conns} connection{'s' * (conns != '1')}", fontsize=10)
        axes[row][0].annotate(
            f"{scenario['title']}\n{result.note()}",
            (0, 1.16),
            xycoords="axes fraction",
            fontsize=7.5,
            color="#444444",
            va="bottom",
        )
    fig.suptitle(
        "Throughput: scriptserve against the FastAPI baselines (wrk, closed loop; "
        "higher is better)",
        fontsize=11,
    )
    fig.tight_layout(h_pad=3.5)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def latency_chart(http: Mapping[str, Result], out: Path) -> None:
    fig, axes = plt.subplots(len(http), 2, figsize=(11, 3.8 * len(http)), squeeze=False)
    for row, (key, result) in enumerate(sorted(http.items())):
        scenario = scenario_runs(result, key)
        for col, conns in enumerate(("32", "1")):
            ax = axes[row][col]
            keys = [k for k in ordered(scenario["runs"]) if conns in scenario["runs"][k]]
            width = 0.38
            for offset, field, hatch in ((-width / 2, "p50_ms", ""), (width / 2, "p99_ms", "//")):
                figures = [spread(scenario["runs"][k][conns], field) for k in keys]
                xs = [i + offset for i in range(len(keys))]
                ax.bar(
                    xs,
                    [f[0] for f in figures],
                    width,
                    color=[color_of(k) for k in keys],
                    hatch=hatch,
                    edgecolor="white",
                    yerr=[[f[0] - f[1] for f in figures], [f[2] - f[0] for f in figures]],
                    capsize=2,
                    ecolor="#333333",
                )
                for x, f in zip(xs, figures, strict=True):
                    ax.annotate(
                        f"{f[0]:.3g}",
                        (x, f[2]),
                        textcoords="offset points",
                        xytext=(0, 2),
                        ha="center",
                        fontsize=6.5,
                    )
            ax.set_xticks(range(len(keys)), [LABELS.get(k, k) for k in keys], fontsize=7.5)
            ax.set_ylabel("ms")
            ax.margins(y=0.15)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
            ax.set_title(
                f"Scenario {key}, {conns} connection{'s' * (conns != '1')}: "
                "p50 (plain), p99 (hatched)",
                fontsize=10,
            )
        axes[row][0].annotate(
            f"{scenario['title']}\n{result.note()}",
            (0, 1.16),
            xycoords="axes fraction",
            fontsize=7.5,
            color="#444444",
            va="bottom",
        )
    fig.suptitle(
        "Latency: scriptserve against the FastAPI baselines (lower is better)", fontsize=11
    )
    fig.tight_layout(h_pad=3.5)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def grpc_chart(result: Result, out: Path) -> None:
    runs = result.document["runs"]
    keys = [k for k in GRPC_LABELS if k in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4))
    colors = ["#9a9a9a" if k.startswith("rest") else SCRIPTSERVE_COLOR for k in keys]
    draw_bars(
        left,
        [
            Bar(GRPC_LABELS[k], c, *spread(runs[k], "rps"))
            for k, c in zip(keys, colors, strict=True)
        ],
        "requests/s",
    )
    left.set_title("Throughput (higher is better)", fontsize=10)
    draw_bars(
        right,
        [
            Bar(GRPC_LABELS[k], c, *spread(runs[k], "p99_ms"))
            for k, c in zip(keys, colors, strict=True)
        ],
        "ms",
        "{:.1f}",
    )
    right.set_title("p99 latency (lower is better)", fontsize=10)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        "Scenario A's MLP on one scriptserve over REST (grey) and gRPC (blue), 32 requests in "
        "flight (connections x streams)\n" + result.note(),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.charts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--http",
        type=Path,
        nargs="*",
        default=[],
        help="http_load results (default: each scenario's newest full run)",
    )
    p.add_argument("--grpc", type=Path, help="a grpc_load result (default: the newest full run)")
    p.add_argument("--out", type=Path, default=IMAGES, help="folder for the PNGs (docs/images)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    http: dict[str, Result] = {}
    for path in args.http:
        result = read(path)
        for key in result.document["scenarios"]:
            http[key] = result
    for key in ("A", "B"):
        if key not in http and (found := newest("http_load", key)) is not None:
            http[key] = found
    grpc = read(args.grpc) if args.grpc else newest("grpc_load")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if http:
        throughput_chart(http, args.out / "bench-throughput.png")
        latency_chart(http, args.out / "bench-latency.png")
        written += ["bench-throughput.png", "bench-latency.png"]
    if grpc is not None:
        grpc_chart(grpc, args.out / "bench-grpc.png")
        written.append("bench-grpc.png")
    for key, result in sorted(http.items()):
        print(f"scenario {key}: {result.path.name}")
    if grpc is not None:
        print(f"gRPC: {grpc.path.name}")
    print("charts: " + ", ".join(str(args.out / name) for name in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
