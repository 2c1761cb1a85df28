"""The raw-ASGI ceiling on uvicorn against the same work behind granian's Rust HTTP front end.

    pip install granian && python -m benchmarks.front_ends [--rounds 5 --seconds 4]

Both echo servers are up at once and loaded in turn (wrk, 32 connections, scenario A's body):
`baselines/raw_asgi.py` on uvicorn + uvloop + httptools (the request_path ceiling) and
`baselines/granian_rsgi.py` on granian (one worker process, one runtime thread, uvloop). For
each load it prints the req/s and the CPU each thread of the server process used per request:
where the per-request work of HTTP is done, and how much of it a Python thread still does.
Ratios are taken within each round; results go to benchmarks/results/front_ends-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks import models
from benchmarks.loadgen import run_wrk
from benchmarks.scenarios import median
from benchmarks.servers import ServerProcess, free_port, uvicorn_app

RESULTS = Path(__file__).resolve().parent / "results"


def granian_app(label: str, app: str) -> ServerProcess:
    granian = shutil.which("granian")
    if granian is None:
        raise SystemExit("granian is not installed: pip install granian (a measuring stick only)")
    port = free_port()
    argv = [
        granian, "--interface", "rsgi", "--workers", "1", "--runtime-threads", "1",
        "--loop", "uvloop", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--no-ws", app,
    ]  # fmt: skip
    return ServerProcess(label, argv, port, "/", {})


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid` and of its children (granian serves from a child)."""
    pids = [pid]
    # pgrep exits 1 when there is no child (uvicorn serves from `pid` itself).
    children = subprocess.run(
        ["pgrep", "-P", str(pid)], check=False, capture_output=True, text=True
    )
    pids += [int(p) for p in children.stdout.split()]
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for each in pids:
        for task in Path(f"/proc/{each}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                name = (task / "comm").read_text().strip()
            except OSError:
                continue  # the thread ended meanwhile
            seconds[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="scriptserve-front-ends-"))
    body = models.build("mlp", work, work / "store").body
    servers = {
        "uvicorn raw ASGI": uvicorn_app("uvicorn", "benchmarks.baselines.raw_asgi:app", {}),
        "granian RSGI": granian_app("granian", "benchmarks.baselines.granian_rsgi:app"),
    }
    runs: dict[str, list[dict[str, object]]] = {label: [] for label in servers}
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.enter_context(server)
            run_wrk(server.url + "/", 32, 2, 2, body)  # warm-up
        for round_ in range(1, args.rounds + 1):
            for label, server in servers.items():
                assert server.proc is not None
                before = thread_cpu(server.proc.pid)
                result = run_wrk(server.url + "/", 32, args.seconds, 2, body)
                after = thread_cpu(server.proc.pid)
                requests = result.rps * args.seconds
                per_thread = sorted(
                    ((after[t] - before.get(t, 0.0)) / requests * 1e6 for t in after),
                    reverse=True,
                )
                busy = [round(us, 1) for us in per_thread if us >= 0.5]
                runs[label].append({"rps": result.rps, "p99_ms": result.p99_ms, "cpu_us": busy})
                print(
                    f"round {round_} {label:<17} {result.rps:8.0f} req/s  p99 {result.p99_ms:5.2f}"
                    f" ms  CPU per request by thread (us): {busy}"
                )
    ratios = [
        float(g["rps"]) / float(u["rps"])  # type: ignore[arg-type]
        for g, u in zip(runs["granian RSGI"], runs["uvicorn raw ASGI"], strict=True)
    ]
    summary = (
        f"granian RSGI / uvicorn raw ASGI: {median(ratios):.2f} "
        f"(rounds: {' '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(summary)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"front_ends-{dt.datetime.now():%Y-%m-%dT%H%M%S}.json"
    path.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    print(f"wrote {path.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
