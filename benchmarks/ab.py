"""Scenario A served by two trees at once, loaded in turn: a before/after comparison whose
ratios are taken round by round, so the machine's drift touches both sides alike.

    git worktree add /tmp/before <commit>
    python -m venv --system-site-packages /tmp/before-venv
    /tmp/before-venv/bin/pip install --no-deps -e /tmp/before
    python -m benchmarks.ab --other /tmp/before-venv/bin/python [--rounds 6] [--seconds 8]
    python -m benchmarks.ab --other-env SCRIPTSERVE_GC_YOUNG_THRESHOLD=700   # a setting instead

Both servers serve the scenario-A MLP archive (benchmarks/models.py) with the scenarios'
settings (workers = CPU count, one intra-op thread, batches of up to 32 with no delay); wrk
loads `/predictions/mlp` with 32 connections, one server at a time, alternating (`--route
oip_json` or `--route oip_binary`: the same row as an Open Inference Protocol infer). The idle
server takes no CPU meanwhile. Prints each round, the medians and the per-round ratios, and
writes them to benchmarks/results/ab-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil

from benchmarks import models, report
from benchmarks.loadgen import run_wrk, wrk_path
from benchmarks.models import Route, routes
from benchmarks.servers import ServerProcess, free_ports

RESULTS = Path(__file__).resolve().parent / "results"


def server(
    label: str, python: str, store: Path, env: dict[str, str], model: str = "mlp"
) -> ServerProcess:
    port, mgmt, metrics, grpc, grpc_mgmt = free_ports(5)
    argv = [
        python, "-m", "scriptserve", "serve", "--model-store", str(store), "--models", "all",
        "--inference-address", f"127.0.0.1:{port}", "--management-address", f"127.0.0.1:{mgmt}",
        "--metrics-address", f"127.0.0.1:{metrics}",
        "--grpc-inference-address", f"127.0.0.1:{grpc}",
        "--grpc-management-address", f"127.0.0.1:{grpc_mgmt}",
        "--workers", str(os.cpu_count() or 1), "--intra-op-threads", "1",
        "--max-batch-size", "32", "--max-batch-delay", "0", "--log-level", "warning",
    ]  # fmt: skip
    return ServerProcess(label, argv, port, f"/v2/models/{model}/ready", env)


def thread_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of process `pid`'s main thread (a server's event loop) and of its
    other threads together (workers, the access log's writer, ...)."""
    loop = others = 0.0
    for thread in psutil.Process(pid).threads():
        if thread.id == pid:
            loop += thread.user_time + thread.system_time
        else:
            others += thread.user_time + thread.system_time
    return loop, others


def alternate(
    servers: dict[str, ServerProcess],
    rounds: int,
    seconds: float,
    body: Path,
    settle: Callable[[], None] | None = None,
    model: str = "mlp",
    route: Route | None = None,
    cpu: dict[str, list[tuple[float, float]]] | None = None,
) -> dict[str, list[float]]:
    """Load each server in turn with wrk (32 connections on scenario A's request, or on
    `route`) for `rounds` rounds after a warm-up; each one's req/s, round by round. Each round
    starts one server later than the one before, so that every server takes every place in the
    order as often (the first place of a round is not the last's). `settle` runs after each
    load, before the next server's: what one server leaves to do after its round (e.g.
    exporting spans) must not be charged to the next. Given `cpu`, each load's CPU per request
    in microseconds, (event loop's thread, the other threads), is appended to `cpu[label]`."""
    if route is None:
        json_post = {"Content-Type": "application/json"}
        route = Route("torchserve", f"/predictions/{model}", body, json_post)
    runs: dict[str, list[float]] = {label: [] for label in servers}
    for s in servers.values():
        run_wrk(s.url + route.path, 32, 3, 2, route.body, route.headers)  # warm-up
        if settle is not None:
            settle()
    order = list(servers.items())
    for round_ in range(rounds):
        shift = round_ % len(order)
        for label, s in order[shift:] + order[:shift]:
            pid = s.proc.pid if cpu is not None and s.proc is not None else None
            loop_s, others_s = thread_seconds(pid) if pid is not None else (0.0, 0.0)
            load = run_wrk(s.url + route.path, 32, seconds, 2, route.body, route.headers)
            runs[label].append(load.rps)
            if cpu is not None and pid is not None and load.requests:
                loop_after, others_after = thread_seconds(pid)
                us = 1e6 / load.requests
                cpu.setdefault(label, []).append(
                    ((loop_after - loop_s) * us, (others_after - others_s) * us)
                )
            if settle is not None:
                settle()
        line = ", ".join(f"{label} {values[-1]:.0f}" for label, values in runs.items())
        print(f"round {round_ + 1}: {line} req/s", flush=True)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--other", default=sys.executable, help="the other tree's python")
    p.add_argument(
        "--other-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment of the other server (repeatable)",
    )
    p.add_argument(
        "--model",
        choices=("mlp", "cnn", "linear"),
        default="mlp",
        help="scenario A's MLP (default), scenario B's CNN, or the 512 -> 10 model "
        "that costs next to nothing (the request path alone)",
    )
    p.add_argument(
        "--route",
        choices=("torchserve", "oip_json", "oip_binary"),
        default="torchserve",
        help="the request: TorchServe's /predictions (default), or the same row as an Open "
        "Inference Protocol infer with a JSON or a binary tensor",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wrk_path()
    other_env = dict(item.split("=", 1) for item in args.other_env)
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="scriptserve-ab-") as tmp:
        store = Path(tmp) / "store"
        model = models.build(args.model, Path(tmp) / "work", store)
        route = next(r for r in routes(model, Path(tmp) / "work") if r.key == args.route)
        servers = {
            "this": server("this", sys.executable, store, {}, args.model),
            "other": server("other", args.other, store, other_env, args.model),
        }
        with servers["this"], servers["other"]:
            runs = alternate(servers, args.rounds, args.seconds, model.body, route=route)
    ratios = [a / b for a, b in zip(runs["this"], runs["other"], strict=True)]
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(
        f"medians: this {medians['this']:.0f} req/s, other {medians['other']:.0f}; "
        f"this / other per round: {' '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.3f})"
    )
    host = report.closing({}, load_before)
    out = args.output or RESULTS / f"ab-{started:%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "ab", "started": started.isoformat(timespec="seconds"),
        "model": args.model, "route": args.route, "other": args.other, "other_env": other_env,
        "seconds": args.seconds, "host": host,
        "runs": runs, "medians": medians, "ratios": ratios,
    }  # fmt: skip
    out.write_text(report.compact_json(document))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
