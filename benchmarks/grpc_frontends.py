"""Could a different gRPC front end serve unary ModelInfer as fast as REST? Its upper bound.

    python -m benchmarks.grpc_frontends            # 3 rounds of 6 s runs: about 3 minutes
    python -m benchmarks.grpc_frontends --before /tmp/before-venv/bin/python

Beside scriptserve (scenario A's MLP, the scenarios' settings) loaded over REST JSON
(`/predictions/mlp`, wrk) and over gRPC unary ModelInfer with raw tensors (h2load), two gRPC
servers that answer ModelInfer with a constant and do nothing else (`baselines/grpc_echo.py`):
grpc.aio on one event loop, and grpc's thread-pool server. Each runs in a process of its own, so
its figure bounds both designs the issue names: a front end in the serving process that holds
the GIL less, and a front-end process feeding the workers through shared memory (which would add
the hand-off to this). 32 connections with one request in flight each, every load in turn, each
round; ratios to scriptserve's REST JSON taken within a round. With `--before`, a scriptserve of
another tree's python is loaded over gRPC ModelInfer too, in the same rounds. Results go to
benchmarks/results/grpc_frontends-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import psutil

from benchmarks import ab, models, report
from benchmarks.grpc_load import GRPC_HEADERS, SERVICE, write_bodies
from benchmarks.loadgen import LoadResult, run_h2load, run_wrk
from benchmarks.scenarios import median
from benchmarks.servers import REPO, ServerProcess, free_port

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def echo_server(mode: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`baselines/grpc_echo.py` in `mode` on a free port, once it answers; (address, process)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "benchmarks.baselines.grpc_echo",
        "--port",
        str(port),
        "--mode",
        mode,
    ]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        yield address, proc
    finally:
        proc.terminate()
        proc.wait(10)


def _grpc_address(server: ServerProcess) -> str:
    return server.argv[server.argv.index("--grpc-inference-address") + 1]


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.grpc_frontends",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--before", help="python of another tree, served over gRPC ModelInfer too")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    load_before = os.getloadavg()
    runs: dict[str, list[LoadResult]] = {}
    cpu_us: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="scriptserve-grpc-fe-") as tmp:
        workdir = Path(tmp)
        model = models.build("mlp", workdir, workdir / "store")
        bodies = write_bodies(model, workdir)
        with contextlib.ExitStack() as stack:
            served = stack.enter_context(
                ab.server("scriptserve", sys.executable, workdir / "store", {})
            )
            grpc_address = _grpc_address(served)
            before = (
                stack.enter_context(ab.server("before", opts.before, workdir / "store", {}))
                if opts.before
                else None
            )
            aio = stack.enter_context(echo_server("aio"))
            sync = stack.enter_context(echo_server("sync"))
            assert served.proc is not None

            def h2(address: str) -> Callable[[float], LoadResult]:
                url = f"http://{address}/{SERVICE.strip('/')}/ModelInfer"
                return lambda s: run_h2load(
                    url, 32, 1, bodies.grpc_infer, GRPC_HEADERS, threads=2, seconds=s
                )

            json_post = {"Content-Type": "application/json"}

            def rest(seconds: float) -> LoadResult:
                url = f"{served.url}/predictions/mlp"
                return run_wrk(url, 32, seconds, 2, bodies.json, json_post)

            loads: dict[str, tuple[Callable[[float], LoadResult], int]] = {
                "scriptserve REST JSON /predictions": (rest, served.proc.pid),
                "scriptserve gRPC ModelInfer": (h2(grpc_address), served.proc.pid),
                **(
                    {"before gRPC ModelInfer": (h2(_grpc_address(before)), before.proc.pid)}
                    if before is not None and before.proc is not None
                    else {}
                ),
                "grpc.aio echo (no model)": (h2(aio[0]), aio[1].pid),
                "grpc thread-pool echo (no model)": (h2(sync[0]), sync[1].pid),
            }
            for load, _ in loads.values():
                load(2.0)  # warm-up
            for round_ in range(opts.rounds):
                print(f"round {round_ + 1}/{opts.rounds}", flush=True)
                for label, (load, pid) in loads.items():
                    before = cpu_seconds(pid)
                    result = load(opts.seconds)
                    used = cpu_seconds(pid) - before
                    runs.setdefault(label, []).append(result)
                    cpu_us.setdefault(label, []).append(used / max(result.requests, 1) * 1e6)
    rest = runs["scriptserve REST JSON /predictions"]
    lines = [
        f"{'load (32 connections, 1 in flight each)':<40}{'req/s':>9}{'p99 ms':>9}"
        f"{'server CPU/req':>16}{'/ REST JSON':>13}"
    ]
    for label, results in runs.items():
        ratios = [r.rps / b.rps for r, b in zip(results, rest, strict=True)]
        lines.append(
            f"{label:<40}{median([r.rps for r in results]):>9.0f}"
            f"{median([r.p99_ms for r in results]):>9.2f}{median(cpu_us[label]):>13.0f} us"
            f"{median(ratios):>12.2f}x"
        )
    if "before gRPC ModelInfer" in runs:
        ours, theirs = runs["scriptserve gRPC ModelInfer"], runs["before gRPC ModelInfer"]
        ratios = [a.rps / b.rps for a, b in zip(ours, theirs, strict=True)]
        rounds = " ".join(f"{r:.2f}" for r in ratios)
        lines.append(f"gRPC ModelInfer, this tree / before: {median(ratios):.3f} ({rounds})")
    host = report.host(load_before)
    lines.append(report.host_line(host))
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"grpc_frontends-{dt.datetime.now():%Y-%m-%dT%H%M%S}.json"
    out.write_text(
        report.compact_json(
            {
                "host": host,
                "rounds": opts.rounds,
                "seconds": opts.seconds,
                "runs": {k: [r.to_dict() for r in v] for k, v in runs.items()},
                "server_cpu_us_per_request": cpu_us,
                "summary": lines,
            }
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
