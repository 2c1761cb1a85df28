"""Scenario A's request against the raw-ASGI ceiling, route by route, and against an older tree.

    python -m benchmarks.request_path                         # 3 rounds of 8 s runs: ~4 minutes
    python -m benchmarks.request_path --before /tmp/before-venv/bin/python

In one run, every server up at once and loaded in turn (wrk, 32 connections, scenario A's MLP
with the scenarios' settings): the raw-ASGI + orjson echo of the same body (the ceiling,
`baselines/raw_asgi.py`), the same work on httptools without ASGI
(`baselines/httptools_echo.py`, what a protocol of scriptserve's own could at best cost), the
bare FastAPI endpoint (scenario A's baseline), and scriptserve on
three routes for the same row: TorchServe's `/predictions/mlp` with the JSON array, OIP's
`/v2/models/mlp/infer` with the tensor as JSON, and the same with OIP's binary tensor extension.
With `--before`, a second scriptserve from another tree's python serves the same three routes.
Ratios are taken within each round, then their median; the results are also written to
benchmarks/results/request_path-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import ab, models, report
from benchmarks.loadgen import LoadResult, run_wrk, wrk_path
from benchmarks.scenarios import median
from benchmarks.servers import ServerProcess, free_port, uvicorn_app

_FIGURES = ("rps", "p50_ms", "p99_ms")
_BASELINES = ("below ASGI", "ceiling", "bare FastAPI")
_BARE = "benchmarks.baselines.bare_fastapi:app"


def _ratios(a: list[LoadResult], b: list[LoadResult]) -> list[float]:
    return [x.rps / y.rps for x, y in zip(a, b, strict=True)]


def _line(label: str, values: list[float], target: float | None = None) -> str:
    rounds = " ".join(f"{v:.2f}" for v in values)
    verdict = (
        ""
        if target is None
        else f"  [target >= {target:g}: " + ("met]" if median(values) >= target else "missed]")
    )
    return f"{label:<52}{median(values):>6.2f}  (rounds: {rounds}){verdict}"


def summarise(runs: dict[str, list[LoadResult]], before: bool) -> list[str]:
    lines = [f"{'server / route':<40}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"]
    for key, results in runs.items():
        rps, p50, p99 = (median([getattr(r, f) for r in results]) for f in _FIGURES)
        lines.append(f"{key:<40}{rps:>9.0f}{p50:>9.2f}{p99:>9.2f}")
    ts = runs["scriptserve torchserve"]
    lines += [
        _line("raw-ASGI ceiling / below ASGI", _ratios(runs["ceiling"], runs["below ASGI"])),
        _line("scriptserve /predictions / raw-ASGI ceiling", _ratios(ts, runs["ceiling"]), 0.5),
        _line("scriptserve /predictions / bare FastAPI", _ratios(ts, runs["bare FastAPI"])),
        _line("OIP JSON / /predictions", _ratios(runs["scriptserve oip_json"], ts), 0.95),
        _line("OIP binary / /predictions", _ratios(runs["scriptserve oip_binary"], ts), 1.0),
        _line(
            "OIP binary / OIP JSON",
            _ratios(runs["scriptserve oip_binary"], runs["scriptserve oip_json"]),
            1.0,
        ),
    ]
    if before:
        for route in ("torchserve", "oip_json", "oip_binary"):
            lines.append(
                _line(
                    f"{route}: this tree / before",
                    _ratios(runs[f"scriptserve {route}"], runs[f"before {route}"]),
                    1.6 if route == "torchserve" else None,
                )
            )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.request_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--before", help="another tree's python, served beside this one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    load_before = os.getloadavg()
    wrk_path()  # fail early, with the install hint, when wrk is missing
    with tempfile.TemporaryDirectory(prefix="scriptserve-path-") as tmp:
        workdir = Path(tmp)
        model = models.build("mlp", workdir, workdir / "store")
        loads = models.routes(model, workdir)
        below = free_port()
        echo = [sys.executable, "-m", "benchmarks.baselines.httptools_echo", "--port", str(below)]
        starts: dict[str, ServerProcess] = {
            "below ASGI": ServerProcess("httptools echo", echo, below, "/", {}),
            "ceiling": uvicorn_app("raw ASGI", "benchmarks.baselines.raw_asgi:app", {}),
            "bare FastAPI": uvicorn_app("bare FastAPI", _BARE, {}),
            "scriptserve": ab.server("scriptserve", sys.executable, workdir / "store", {}),
        }
        if opts.before:
            starts["before"] = ab.server("before", opts.before, workdir / "store", {})
        runs: dict[str, list[LoadResult]] = {}
        with contextlib.ExitStack() as stack:
            servers = {k: stack.enter_context(s) for k, s in starts.items()}
            plan = [
                (key if key in _BASELINES else f"{key} {r.key}", s, r)
                for key, s in servers.items()
                for r in (loads[:1] if key in _BASELINES else loads)
            ]
            for _, s, r in plan:
                run_wrk(s.url + r.path, 32, opts.warmup, 2, r.body, r.headers)
            for round_ in range(opts.rounds):
                print(
                    f"round {round_ + 1}/{opts.rounds} (load average {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                for key, s, r in plan:
                    result = run_wrk(s.url + r.path, 32, opts.seconds, 2, r.body, r.headers)
                    if result.errors:
                        raise SystemExit(f"{key}: {result.errors} errors in a measured run")
                    runs.setdefault(key, []).append(result)
    lines = summarise(runs, opts.before is not None)
    host = report.host(load_before)
    lines.append(report.host_line(host))
    print("\n".join(lines))
    document = {
        "host": host,
        "rounds": opts.rounds,
        "seconds": opts.seconds,
        "runs": {k: [r.to_dict() for r in v] for k, v in runs.items()},
        "summary": lines,
    }
    report.write_results("request_path", document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
