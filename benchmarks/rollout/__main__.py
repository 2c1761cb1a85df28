"""`python -m benchmarks.rollout`: run the time line on scenario A's MLP, print it and write the
result file."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import signal
import sys
import tempfile
from pathlib import Path

import benchmarks.rollout
from benchmarks import models, report
from benchmarks.rollout.haproxy import CHECK_INTERVAL_MS, NO_HAPROXY, RETRY_ON, haproxy_path
from benchmarks.rollout.scenario import Rollout, rollout, summary, timeline

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _finite(value: float) -> float | None:
    """JSON has no NaN: a figure without a whole second to take it from is null."""
    return None if math.isnan(value) else value


def document(result: Rollout, args: argparse.Namespace, started: dt.datetime) -> dict[str, object]:
    restarts = [
        {**vars(event), **figures}
        for event, figures in zip(result.restarts, result.figures(), strict=True)
    ]
    for entry in restarts:
        for key, value in entry.items():
            if isinstance(value, float):
                entry[key] = _finite(value)
    problems = [vars(o) for o in result.outcomes if o.kind != "succeeded"]
    return {
        "benchmark": "rollout",
        "started": started.isoformat(timespec="seconds"),
        "replicas": args.replicas,
        "connections": args.connections,
        "warm_seconds": args.warm_seconds,
        "seconds_per_phase": args.seconds_per_phase,
        "haproxy": {
            "balance": args.balance,
            "retry_on": args.retry_on,
            "check_interval_ms": CHECK_INTERVAL_MS,
            "counters": result.haproxy,
        },
        "counts": result.counts,
        "steady_rps": _finite(result.steady_before()),
        "restarts": restarts,
        "per_second": result.series,
        "not_succeeded": problems[:100],
        "client_cpu": result.client_cpu,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.rollout",
        description=benchmarks.rollout.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--seconds-per-phase",
        type=float,
        default=6.0,
        help="steady load before the first restart and after each one",
    )
    p.add_argument("--warm-seconds", type=float, default=3.0)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--balance", choices=("roundrobin", "leastconn"), default="leastconn")
    p.add_argument("--retry-on", default=RETRY_ON, help=f"haproxy's retry-on (default {RETRY_ON})")
    p.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if args.replicas < 2:
        p.error("--replicas: at least 2, so that one serves while another restarts")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if haproxy_path() is None:
        raise SystemExit(NO_HAPROXY)
    # A SIGTERM to the benchmark unwinds like an error, so every child is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="scriptserve-rollout-") as tmp:
        store = Path(tmp) / "store"
        model = models.build("mlp", Path(tmp) / "work", store)
        result = rollout(
            store,
            model.name,
            model.body.read_bytes(),
            replicas=args.replicas,
            warm_s=args.warm_seconds,
            phase_s=args.seconds_per_phase,
            connections=args.connections,
            balance=args.balance,
            retry_on=args.retry_on,
        )
    print("requests answered 200 per second:")
    print("\n".join(timeline(result)))
    print("\n".join(summary(result)))
    host = report.host(load_before)
    print(report.host_line(host))
    out = args.output or RESULTS / f"rollout-{started:%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.compact_json({**document(result, args, started), "host": host}))
    print(f"results: {out}")
    lost = result.counts["failed"] + result.counts["unanswered"]
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
