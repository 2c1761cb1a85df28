"""scriptserve over HTTP against hand-written FastAPI baselines, loaded by wrk.

    python -m benchmarks.http_load            # 3 rounds of 10 s runs; about 15 minutes
    python -m benchmarks.http_load --quick    # 1 round of 3 s runs

The scenarios and their baselines are described in `benchmarks/scenarios.py`. Every server of a
scenario runs at the same time, on free loopback ports, and is loaded in turn: 32 connections,
then 1, each run after a warm-up. Rounds repeat the whole sequence; the table shows medians over
rounds, and ratios are taken within a round, then their median. A trivial GET is loaded too: its
requests/s, far above a scenario's, shows that wrk is not what limits the figures. The results
are also written to benchmarks/results/http_load-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import report
from benchmarks.loadgen import Run, run_wrk, wrk_path
from benchmarks.models import model_latency_ms
from benchmarks.scenarios import Scenario, Summary, build_scenarios
from benchmarks.servers import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
CONNECTIONS = (32, 1)


@dataclass(frozen=True)
class Options:
    seconds: float
    warmup: float
    repeats: int
    wrk_threads: int
    workers: int
    intra_op_threads: int


def measure(
    server: ServerProcess, path: str, connections: int, opts: Options, body: Path | None
) -> Run:
    """Warm up, then one measured run, with the server's CPU use and batch sizes over it."""
    url = server.url + path
    run_wrk(url, connections, opts.warmup, opts.wrk_threads, body)
    cpu = server.cpu_seconds()
    requests, batches = server.batch_counts()
    started = time.monotonic()
    load = run_wrk(url, connections, opts.seconds, opts.wrk_threads, body)
    cpu = (server.cpu_seconds() - cpu) / (time.monotonic() - started)
    requests_after, batches_after = server.batch_counts()
    ran = batches_after - batches
    return Run(load, cpu, (requests_after - requests) / ran if ran else None)


def run_scenario(scenario: Scenario, opts: Options) -> None:
    with contextlib.ExitStack() as stack:
        servers = {c.key: stack.enter_context(c.start()) for c in scenario.contenders}
        path = f"/predictions/{scenario.model.name}"
        for round_ in range(opts.repeats):
            scenario.load_average.append(os.getloadavg()[0])
            print(
                f"  scenario {scenario.key}, round {round_ + 1}/{opts.repeats} "
                f"(load average {scenario.load_average[-1]:.1f})",
                flush=True,
            )
            for c in scenario.contenders:
                if c.key == "batching_on" or c is scenario.contenders[0]:
                    run = measure(servers[c.key], c.trivial_path, 32, opts, None)
                    scenario.trivial.setdefault(c.key, []).append(run.load)
            for connections in CONNECTIONS:
                if connections == 1:
                    scenario.model_ms.append(model_latency_ms(scenario.model, threads=1))
                for c in scenario.contenders:
                    run = measure(servers[c.key], path, connections, opts, scenario.model.body)
                    scenario.runs.setdefault(c.key, {}).setdefault(connections, []).append(run)


def to_json(scenario: Scenario, summary: Summary) -> dict[str, object]:
    return {
        "title": scenario.title,
        "model": scenario.model.name,
        "body_bytes": scenario.model.body.stat().st_size,
        "load_average_per_round": scenario.load_average,
        "model_latency_ms": scenario.model_ms,
        "runs": {
            key: {str(conns): [run.to_dict() for run in runs] for conns, runs in by_conns.items()}
            for key, by_conns in scenario.runs.items()
        },
        "trivial_get": {k: [r.to_dict() for r in v] for k, v in scenario.trivial.items()},
        "summary": asdict(summary),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.http_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="3 s runs, 1 s warm-up, 1 round")
    p.add_argument("--seconds", type=float, help="length of each measured run (default 10)")
    p.add_argument("--warmup", type=float, help="warm-up before each run (default 2)")
    p.add_argument("--repeats", type=int, help="rounds (default 3)")
    p.add_argument("--scenarios", default="AB", help="which scenarios to run: A, B or AB")
    p.add_argument(
        "--wrk-threads",
        type=int,
        default=2,
        help="wrk threads (default 2; see benchmarks/README.md)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="scriptserve workers per model (default: the CPU count)",
    )
    p.add_argument(
        "--intra-op-threads",
        type=int,
        default=1,
        help="torch threads per model call, servers and baselines alike",
    )
    p.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wrk_path()
    opts = Options(
        seconds=args.seconds or (3.0 if args.quick else 10.0),
        warmup=args.warmup or (1.0 if args.quick else 2.0),
        repeats=args.repeats or (1 if args.quick else 3),
        wrk_threads=args.wrk_threads,
        workers=args.workers,
        intra_op_threads=args.intra_op_threads,
    )
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    print(f"http_load: {opts}", flush=True)
    with tempfile.TemporaryDirectory(prefix="scriptserve-bench-") as tmp:
        chosen = [
            s
            for s in build_scenarios(Path(tmp), opts.workers, opts.intra_op_threads)
            if s.key in args.scenarios.upper()
        ]
        results = []
        for scenario in chosen:
            run_scenario(scenario, opts)
            results.append((scenario, scenario.summarise()))
        host = report.host(load_before)
        document = {
            "benchmark": "http_load",
            "started": started.isoformat(timespec="seconds"),
            "options": asdict(opts),
            "host": host,
            "scenarios": {s.key: to_json(s, summary) for s, summary in results},
        }
    print()
    for scenario, summary in results:
        print(report.table(scenario, summary))
    print(report.host_line(host))
    suffix = "-quick" if args.quick else ""
    out = args.output or RESULTS / f"http_load-{started:%Y-%m-%dT%H%M%S}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.compact_json(document))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
