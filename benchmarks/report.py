"""The printed table (medians over rounds), the verdict on each target, and the JSON file."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.loadgen import Run
from benchmarks.scenarios import SCRIPTSERVE, Scenario, Summary, median
from scriptserve.archiver.pt2_package import cpu_features, int8_isa

_HEADER = (
    f"{'server':<38}{'conns':>6}{'req/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
    f"{'errors':>7}{'srv CPU':>8}{'wrk CPU':>8}{'batch':>7}"
)
CEILING_TARGET = 0.5
"""Scenario A: scriptserve's share of what the bare HTTP stack serves."""
_VARIANT = {"batching_on": "batching on", "batching_off": "batching off"}


def _row(label: str, conns: int, runs: Sequence[Run]) -> str:
    loads = [r.load for r in runs]
    batches = [r.mean_batch for r in runs if r.mean_batch is not None]
    return (
        f"{label:<38}{conns:>6}{median([r.rps for r in loads]):>9.0f}"
        f"{median([r.p50_ms for r in loads]):>9.2f}{median([r.p90_ms for r in loads]):>9.2f}"
        f"{median([r.p99_ms for r in loads]):>9.2f}{sum(r.errors for r in loads):>7}"
        f"{median([r.server_cpu for r in runs]):>8.2f}{median([r.client_cpu for r in loads]):>8.2f}"
        + (f"{median(batches):>7.1f}" if batches else f"{'-':>7}")
    )


def _rounds(values: Sequence[float], fmt: str) -> str:
    if len(values) < 2:
        return ""
    return " (rounds: " + " ".join(format(v, fmt) for v in values) + ")"


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


def table(scenario: Scenario, summary: Summary) -> str:
    rounds = len(summary.baseline)
    lines = [
        f"Scenario {scenario.key}: {scenario.title} (median of {rounds} round{'s' * (rounds > 1)})",
        _HEADER,
    ]
    for conns in sorted({c for by in scenario.runs.values() for c in by}, reverse=True):
        for c in scenario.contenders:
            lines.append(_row(c.label, conns, scenario.runs[c.key][conns]))
    labels = {c.key: c.label for c in scenario.contenders}
    headroom = ", ".join(
        f"{labels[k]} {median([r.rps for r in v]):.0f} req/s (wrk CPU "
        f"{median([r.client_cpu for r in v]):.2f})"
        for k, v in scenario.trivial.items()
    )
    lines.append(f"trivial GET, 32 connections (wrk headroom): {headroom}")
    if sum(c.is_baseline for c in scenario.contenders) > 1:
        lines.append(
            f"baseline, the faster at 32 connections, per round: "
            f"{', '.join(labels[k] for k in summary.baseline)}"
        )
    on = median(summary.rps_ratio["batching_on"])
    ratios = ", ".join(
        f"{_VARIANT[k]} {median(summary.rps_ratio[k]):.2f}{_rounds(summary.rps_ratio[k], '.2f')}"
        for k in SCRIPTSERVE
    )
    p99_on, p99_base = median(summary.p99_ms["batching_on"]), median(summary.baseline_p99_ms)
    met = on >= scenario.target_ratio and (scenario.key != "B" or p99_on < p99_base)
    goal = f">= {scenario.target_ratio:g}" + (" with lower p99" if scenario.key == "B" else "")
    lines.append(
        f"req/s scriptserve / baseline, 32 connections: {ratios}  "
        f"[target {goal}, batching on: {_verdict(met)}]"
    )
    lines.append(
        f"p99, 32 connections: baseline {p99_base:.2f} ms, "
        + ", ".join(f"{_VARIANT[k]} {median(summary.p99_ms[k]):.2f} ms" for k in SCRIPTSERVE)
    )
    if summary.ceiling_ratio["batching_on"]:
        ceiling = summary.ceiling_ratio["batching_on"]
        lines.append(
            f"req/s scriptserve batching on / raw-ASGI ceiling, 32 connections: "
            f"{median(ceiling):.2f}{_rounds(ceiling, '.2f')}  "
            f"[target >= {CEILING_TARGET:g}: {_verdict(median(ceiling) >= CEILING_TARGET)}]"
        )
    over = {k: median(summary.p50_over_model_ms[k]) for k in SCRIPTSERVE}
    lines.append(
        f"1 connection: model alone {median(scenario.model_ms):.3f} ms (batch 1, in-process); "
        "scriptserve p50 above it: "
        + ", ".join(f"{_VARIANT[k]} {over[k]:+.2f} ms" for k in SCRIPTSERVE)
        + f"  [target <= 1 ms: {_verdict(all(v <= 1.0 for v in over.values()))}]"
    )
    return "\n".join(lines) + "\n"


RESULTS = Path(__file__).resolve().parent / "results"


def cpu_line() -> str:
    """This machine's CPU as every figure records it: its model, how many, the vector and
    matrix instructions that change the figures (AVX2, AVX-512, VNNI, BF16, AMX) and the ones
    oneDNN's int8 kernels use."""
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "unknown CPU",
    )
    features = set(cpu_features())
    isa = [
        f
        for f in ("avx2", "avx512_f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
        if f in features
    ]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa)} (int8 kernels: {int8_isa()})"


def host(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """The machine around a run: its CPU (`cpu_line`), and the load average before and now."""
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_line(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def closing(targets: Mapping[str, bool], load_before: tuple[float, float, float]) -> dict[str, Any]:
    """Print each target, met or MISSED, and the host line with its CPU (model and ISA); the
    host as the results file records it."""
    for name, met in targets.items():
        print(f"  {name}: {'met' if met else 'MISSED'}")
    found = host(load_before)
    print(host_line(found))
    return found


def write_results(kind: str, document: Mapping[str, Any]) -> Path:
    """`document` as benchmarks/results/<kind>-<date and minute>.json; says where on stdout."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{kind}-{dt.datetime.now():%Y-%m-%dT%H%M%S}.json"
    out.write_text(compact_json(document))
    print(f"wrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")
    return out


def host_line(host: Mapping[str, Any]) -> str:
    before = ", ".join(f"{v:.1f}" for v in host["load_average_before"])
    after = ", ".join(f"{v:.1f}" for v in host["load_average_after"])
    return (
        f"host: {host['cpus']} CPUs; load average (1, 5, 15 min) before {before}, after {after}; "
        f"other work on the machine shows up as noise; {host['cpu']}"
    )


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def compact_json(document: Mapping[str, Any]) -> str:
    """Indented JSON with floats to 3 decimals and each innermost object or list on one line."""
    text = json.dumps(_rounded(document), indent=1)
    flat = re.compile(r"[\[{][^\[\]{}]*[\]}]")
    return flat.sub(lambda m: " ".join(m.group().split()), text) + "\n"
