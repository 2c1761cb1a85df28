"""`python -m benchmarks.dashboard`: serve the MLP, scrape it, load it, query every panel and draw
the dashboard."""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import benchmarks.dashboard
from benchmarks import models
from benchmarks.dashboard.draw import draw
from benchmarks.dashboard.load import PhaseRun, drive, plan
from benchmarks.dashboard.panels import DASHBOARD, Window, read_panel, variables
from benchmarks.dashboard.prometheus import (
    JOB,
    RATE_INTERVAL,
    SCRAPE_S,
    STEP_S,
    Prometheus,
    prometheus_binary,
)
from benchmarks.dashboard.units import format_value
from benchmarks.loadgen import wrk_path
from benchmarks.servers import REPO, scriptserve


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dashboard",
        description=benchmarks.dashboard.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        server = scriptserve(
            "scriptserve", store, "mlp", workers=workers, intra_op_threads=1, max_batch_size=32
        )
        with server:
            assert server.metrics_url is not None
            target = urllib.parse.urlsplit(server.metrics_url).netloc
            with Prometheus(binary, Path(tmp) / "prometheus", target) as prom:
                print(
                    f"server {server.url}, {workers} thread workers; Prometheus {prom.url} "
                    f"scraping {target} every {SCRAPE_S} s"
                )
                runs = drive(server.url, model.body, plan(args.seconds))
                # A scrape before the load stopped, so that stats and the graphs' last points
                # show the server under load rather than the instant after.
                start, end = runs[0].started, runs[-1].ended - SCRAPE_S
                prom.wait_for_scrape_after(runs[-1].ended)
                counted = sum(
                    float(r["value"][1])
                    for r in prom.query(
                        f'sum(scriptserve_requests_total{{job="{JOB}"}})', time.time()
                    )
                )
                window = Window(start, end, variables(dashboard, start, end))
                prom.queries = 0
                panels = [
                    read_panel(prom, p, window) for p in dashboard["panels"] if p["type"] != "row"
                ]
                queries = prom.queries
    sent = sum((r.load.requests if r.load else 0) + sum(r.bad.values()) for r in runs)
    print(f"requests: wrk and httpx had {sent} answered, the server counted {counted:.0f}")
    draw(dashboard, panels, window, runs, load_summary(runs, workers), args.out)
    print(
        f"dashboard {dashboard['title']!r}: {len(panels)} panels, {queries} queries over "
        f"{end - start:.0f} s; variables {window.variables}"
    )
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
