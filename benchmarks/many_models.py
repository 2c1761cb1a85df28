"""Many models on one node: 200 small archives, a memory budget that holds about 20 of them,
Zipf traffic from 32 clients; against the same traffic with every model loaded up front.

    python -m benchmarks.many_models [--models 200] [--fit 20] [--seconds 60] [--clients 32]

The models are `benchmarks.models.Holder` TorchScript archives (directories: nothing to extract
at registration) of 1 to 8 MiB of weights, sizes log-uniform; model popularity follows a Zipf
law (s = 1.1) over a seeded shuffle of the models, so popularity does not follow size. Each
client sends one request at a time to a model drawn from it, for `--seconds`.

1. Sizing: a server without a budget, every model lazy, under the same clients asking only
   for the `--fit` most popular models for 20 s: its peak resident size (every one of them
   loaded, and the runtime under this traffic) is the budget.
2. Lazy: `--lazy-load --memory-budget <that>`. A request is cold when its model was not
   loaded when it was sent (read from the server's own log of loads and unloads), else warm;
   the models loaded are counted once a second from the same log.
3. Preloaded: every model loaded at registration, no budget: the baseline for warm latency.
4. What a `/metrics` scrape of the preloaded server costs: a liveness request every 5 ms
   while it is scraped five times.
5. A `.pt2` model's cold load: the MLP of `benchmarks.models` as a `.pt2` archive, registered
   lazily three times under three names: the first request of each, and its load's seconds.

Prints the figures with the targets (peak RSS <= budget + 10 %, no failed request, warm p99
within 1.2x the preloaded run's, a cold `.pt2` load <= 0.5 s) and writes
benchmarks/results/many_models-<date>.json with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import re
import secrets
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from benchmarks import models, report
from benchmarks.pt2 import pt2_archive
from benchmarks.servers import REPO, ServerProcess, free_ports

WORK = REPO / "build" / "many_models"
KEY = secrets.token_urlsafe(24)
"""The management API's key for the servers this benchmark starts."""
BODY = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
_EVENT = re.compile(
    r"^(\S+ \S+) INFO scriptserve\.memory: model=(\S+) version=\S+ (loaded in|unloaded)"
)


@dataclass
class Sent:
    model: int
    at: float
    """time.time() when it was sent."""
    seconds: float
    status: int
    right: bool
    """Answered by the model it named."""


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)
    peak_rss: int = 0
    metrics: str = ""
    log: str = ""


# -- the store ---------------------------------------------------------------------------------
def sizes_mib(count: int) -> list[float]:
    rng = np.random.default_rng(0)
    return [round(float(v), 2) for v in np.exp(rng.uniform(np.log(1.0), np.log(8.0), count))]


def store_of(count: int) -> Path:
    """The holders' store under build/, made once for a count and reused."""
    root = WORK / f"holders-{count}"
    spec = root / "sizes.json"
    sizes = sizes_mib(count)
    if not (spec.is_file() and json.loads(spec.read_text()) == sizes):
        if root.exists():
            shutil.rmtree(root)
        started = time.perf_counter()
        models.build_holders(root, sizes, archive_format="no-archive")
        spec.write_text(json.dumps(sizes))
        print(f"built {count} archives in {time.perf_counter() - started:.0f} s", flush=True)
    return root / "store"


def popularity(count: int, s: float = 1.1) -> tuple[list[int], list[float]]:
    """Models in order of popularity (a seeded shuffle) and their Zipf weights."""
    order = list(range(count))
    random.Random(1).shuffle(order)
    return order, [1 / (rank + 1) ** s for rank in range(count)]


# -- a server ----------------------------------------------------------------------------------
def server(label: str, store: Path, *args: str) -> ServerProcess:
    port, mgmt, metrics, grpc, grpc_mgmt = free_ports(5)
    argv = [
        sys.executable, "-m", "scriptserve", "serve", "--model-store", str(store),
        "--models", "all", "--workers", "1", "--intra-op-threads", "1", "--no-snapshot",
        "--inference-address", f"127.0.0.1:{port}",
        "--management-address", f"127.0.0.1:{mgmt}",
        "--metrics-address", f"127.0.0.1:{metrics}",
        "--grpc-inference-address", f"127.0.0.1:{grpc}",
        "--grpc-management-address", f"127.0.0.1:{grpc_mgmt}",
        "--enable-model-api", *args,
    ]  # fmt: skip
    process = ServerProcess(
        label, argv, port, "/v2/health/ready", {"SCRIPTSERVE_MANAGEMENT_KEY": KEY}
    )
    process.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    process.mgmt_url = f"http://127.0.0.1:{mgmt}"  # type: ignore[attr-defined]
    return process


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for found in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(found.group(2))
    return total


def scrape(process: ServerProcess) -> str:
    assert process.metrics_url is not None
    with urllib.request.urlopen(process.metrics_url, timeout=10) as answer:
        return str(answer.read().decode())


def full_log(process: ServerProcess) -> str:
    process._log.seek(0)
    return process._log.read().decode(errors="replace")


class PeakRss:
    """The server's resident size (its process and its children), sampled every 50 ms."""

    def __init__(self, server: ServerProcess) -> None:
        assert server.proc is not None
        self.process = psutil.Process(server.proc.pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            try:
                procs = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# -- traffic -----------------------------------------------------------------------------------
async def traffic(
    url: str, count: int, clients: int, seconds: float, among: int | None = None
) -> list[Sent]:
    """`clients` closed loops for `seconds`, models drawn by popularity (only the `among` most
    popular when given)."""
    order, weights = popularity(count)
    if among is not None:
        order, weights = order[:among], weights[:among]
    sent: list[Sent] = []

    async def client(http: httpx.AsyncClient, rng: random.Random, until: float) -> None:
        while time.monotonic() < until:
            model = rng.choices(order, weights)[0]
            at, started = time.time(), time.perf_counter()
            answer = await http.post(f"{url}/v2/models/m{model}/infer", json=BODY)
            seconds = time.perf_counter() - started
            right = answer.status_code == 200 and answer.json()["outputs"][0]["data"][0] == model
            sent.append(Sent(model, at, seconds, answer.status_code, right))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        until = time.monotonic() + seconds
        await asyncio.gather(*(client(http, random.Random(c), until) for c in range(clients)))
    return sent


def run(
    process: ServerProcess, count: int, clients: int, seconds: float, among: int | None = None
) -> Run:
    peak = PeakRss(process)
    sent = asyncio.run(traffic(process.url, count, clients, seconds, among))
    return Run(sent, peak.stop(), scrape(process), full_log(process))


# -- figures -----------------------------------------------------------------------------------
def loaded_spans(log: str) -> dict[int, list[tuple[float, float]]]:
    """Per model, the spans of time.time() during which it was loaded, from the server's log."""
    spans: dict[int, list[tuple[float, float]]] = {}
    opened: dict[int, float] = {}
    for line in log.splitlines():
        found = _EVENT.match(line)
        if found is None:
            continue
        stamp, model, event = found.groups()
        at = time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S"))
        at += int(stamp.split(",")[1]) / 1000
        ident = int(model.removeprefix("m"))
        if event == "loaded in":
            opened[ident] = at
        elif ident in opened:
            spans.setdefault(ident, []).append((opened.pop(ident), at))
    for ident, since in opened.items():
        spans.setdefault(ident, []).append((since, float("inf")))
    return spans


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    ms = np.asarray(values) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def figures(result: Run, seconds: float, cold_of: Callable[[Sent], bool]) -> dict[str, Any]:
    ok = [s for s in result.sent if s.status == 200 and s.right]
    warm = [s.seconds for s in ok if not cold_of(s)]
    cold = [s.seconds for s in ok if cold_of(s)]
    loads = metric(result.metrics, "scriptserve_model_loads_total")
    evictions = metric(result.metrics, "scriptserve_model_evictions_total")
    return {
        "requests": len(result.sent),
        "failed": len(result.sent) - len(ok),
        "statuses": dict(sorted(_count(s.status for s in result.sent).items())),
        "throughput_rps": len(result.sent) / seconds,
        "hit_rate": len(warm) / len(ok) if ok else None,
        "warm": {"requests": len(warm), **percentiles(warm)},
        "cold": {"requests": len(cold), **percentiles(cold)},
        "loads": loads,
        "evictions": evictions,
        "loads_per_s": loads / seconds,
        "evictions_per_s": evictions / seconds,
        "peak_rss_bytes": result.peak_rss,
        "models_loaded_median": _loaded_median(result),
        "load_seconds_median": _load_median(result.log),
    }


def _count(values: Any) -> dict[int, int]:
    counts: dict[int, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def _loaded_median(result: Run) -> float | None:
    """The median number of models loaded, once a second over the run (from the log's spans;
    a run with no load or unload logged holds every model it registered)."""
    spans = loaded_spans(result.log)
    if not spans or not result.sent:
        return None
    start = min(s.at for s in result.sent)
    end = max(s.at for s in result.sent)
    counts = [
        sum(1 for held in spans.values() if any(a <= t < b for a, b in held))
        for t in np.arange(start, end, 1.0)
    ]
    return float(statistics.median(counts)) if counts else None


def _load_median(log: str) -> float | None:
    found = [float(m) for m in re.findall(r"loaded in ([0-9.]+) s", log)]
    return statistics.median(found) if found else None


# -- the steps ---------------------------------------------------------------------------------
def size_budget(store: Path, count: int, fit: int, clients: int) -> tuple[int, dict[str, Any]]:
    """The budget that holds the `fit` most popular models: the peak resident size of a server
    without a budget under the same clients, asking only for those (so holding them all)."""
    with server("sizing", store, "--lazy-load") as process:
        sizing = run(process, count, clients, 20.0, among=fit)
    held = [
        float(v)
        for v in re.findall(
            r"^scriptserve_model_resident_bytes\{.*\} (\S+)$", sizing.metrics, re.MULTILINE
        )
        if float(v) > 0
    ]
    return sizing.peak_rss, {
        "baseline_bytes": metric(sizing.metrics, "scriptserve_memory_baseline_bytes"),
        "models_held": len(held),
        "models_bytes": sum(held),
        "runtime_under_traffic_bytes": sizing.peak_rss - sum(held),
    }


def scrape_stall(process: ServerProcess, scrapes: int = 5) -> dict[str, float]:
    """What a Prometheus scrape of every model's metrics costs the other requests: a liveness
    request every 5 ms from one client while `/metrics` is scraped `scrapes` times."""
    stop = threading.Event()
    pings: list[float] = []

    def ping() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                started = time.perf_counter()
                http.get(f"{process.url}/v2/health/live")
                pings.append(time.perf_counter() - started)
                time.sleep(0.005)

    pinger = threading.Thread(target=ping)
    pinger.start()
    took = []
    try:
        time.sleep(0.5)
        for _ in range(scrapes):
            started = time.perf_counter()
            scrape(process)
            took.append(time.perf_counter() - started)
            time.sleep(0.5)
    finally:
        stop.set()
        pinger.join()
    return {
        "scrape_ms_median": statistics.median(took) * 1000,
        "liveness_ms_max": max(pings) * 1000,
        "liveness_ms_median": statistics.median(pings) * 1000,
    }


def pt2_cold_loads(work: Path) -> dict[str, Any]:
    store = work / "pt2-store"
    archive = store / "mlp.mar"
    if not archive.exists():
        models.build("mlp", work / "pt2-work", work / "pt2-ts-store")
        pt2_archive("mlp", store, work / "pt2-work")
    body = {"inputs": [{"name": "x", "shape": [1, 512], "datatype": "FP32", "data": [0.1] * 512}]}
    with server("pt2", store, "--lazy-load") as process:
        mgmt = process.mgmt_url  # type: ignore[attr-defined]
        first, second = [], []
        with httpx.Client(timeout=120) as http:
            for i in range(3):
                params = {"url": "mlp.mar", "model_name": f"mlp{i}", "load": "lazy"}
                headers = {"Authorization": f"Bearer {KEY}"}
                http.post(f"{mgmt}/models", params=params, headers=headers).raise_for_status()
                for times in (first, second):
                    started = time.perf_counter()
                    answer = http.post(f"{process.url}/v2/models/mlp{i}/infer", json=body)
                    answer.raise_for_status()
                    times.append(time.perf_counter() - started)
        loads = [float(m) for m in re.findall(r"loaded in ([0-9.]+) s", full_log(process))]
    return {
        "first_request_s": first,
        "second_request_s": second,
        "load_s": loads,
        "first_request_median_s": statistics.median(first),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.many_models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", type=int, default=200)
    p.add_argument("--fit", type=int, default=20, help="models of median size the budget holds")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=32)
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    started = dt.datetime.now().astimezone()
    store = store_of(args.models)
    budget, sizing = size_budget(store, args.models, args.fit, args.clients)
    print(f"budget {budget / 2**20:.0f} MiB: {json.dumps(report._rounded(sizing))}", flush=True)

    with server("lazy", store, "--lazy-load", "--memory-budget", str(budget)) as process:
        lazy = run(process, args.models, args.clients, args.seconds)
    spans = loaded_spans(lazy.log)

    def cold(s: Sent) -> bool:
        return not any(a <= s.at < b for a, b in spans.get(s.model, []))

    lazy_figures = figures(lazy, args.seconds, cold)
    with server("preloaded", store) as process:
        preloaded = run(process, args.models, args.clients, args.seconds)
        stall = scrape_stall(process)
    preloaded_figures = figures(preloaded, args.seconds, lambda s: False)
    print(f"a scrape of {args.models} models: {json.dumps(report._rounded(stall))}")
    pt2 = pt2_cold_loads(WORK)

    warm_p99, base_p99 = lazy_figures["warm"]["p99_ms"], preloaded_figures["warm"]["p99_ms"]
    targets = {
        "peak_rss_within_budget_plus_10pct": lazy_figures["peak_rss_bytes"] <= budget * 1.1,
        "no_failed_request": lazy_figures["failed"] == 0 and preloaded_figures["failed"] == 0,
        "warm_p99_within_1.2x_preloaded": warm_p99 is not None and warm_p99 <= 1.2 * base_p99,
        "pt2_cold_load_within_0.5s": pt2["first_request_median_s"] <= 0.5,
    }
    for label, found in (("lazy", lazy_figures), ("preloaded", preloaded_figures)):
        print(f"{label}: {json.dumps(report._rounded(found))}")
    print(f"pt2 cold loads: {json.dumps(report._rounded(pt2))}")
    print(
        f"peak RSS {lazy_figures['peak_rss_bytes'] / 2**20:.0f} MiB against a budget of "
        f"{budget / 2**20:.0f} MiB ({lazy_figures['peak_rss_bytes'] / budget:.2f}x); warm p99 "
        f"{warm_p99:.1f} ms against {base_p99:.1f} ms preloaded ({warm_p99 / base_p99:.2f}x)"
    )
    host = report.closing(targets, load_before)
    report.write_results(
        "many_models",
        {
            "benchmark": "many_models",
            "started": started.isoformat(timespec="seconds"),
            "host": host,
            "models": args.models,
            "fit": args.fit,
            "seconds": args.seconds,
            "clients": args.clients,
            "zipf_s": 1.1,
            "budget_bytes": budget,
            "sizing": sizing,
            "lazy": lazy_figures,
            "preloaded": preloaded_figures,
            "pt2": pt2,
            "scrape": stall,
            "targets": targets,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
