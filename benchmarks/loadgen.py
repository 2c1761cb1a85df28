"""The load generators: closed-loop load, requests/s and latency percentiles.

wrk (HTTP/1.1): its Lua `done` hook prints one JSON line with exact figures (requests, duration,
errors and the 50/90/99th latency percentiles in microseconds), which is what gets parsed;
`--latency` keeps wrk's own human-readable distribution in the raw output for anyone reading it.

h2load (HTTP/2, so gRPC): its summary gives requests/s and the succeeded/failed counts and status
classes; the percentiles come from its `--log-file`, one line per request of the measured run.
h2load sees HTTP statuses only: a gRPC error is an HTTP 200 with a `grpc-status` trailer, so
callers must check success another way (benchmarks/grpc_load.py counts the server's answers).

`steady_load` (HTTP/1.1, Python threads): for requests that take seconds (the zoo's models on a
CPU), where a wrk run from cold undercounts: its first answers come one latency after the start,
and the requests a warm-up run leaves in flight are still computed into the measured run (a
10 s wrk run measured ViT-B/16 at 1.6 images/s where the server answered 3.7 a second in steady
state). It counts only what is answered inside a window that opens after a warm-up on the same
connections, and waits for every request it sent before returning.

grpc_loadgen (benchmarks/grpc_client, C++ on Debian's gRPC, built on first use): closed-loop gRPC
ModelInfer calls or ModelStreamInfer messages, one outstanding per client; it checks every answer
(status, a stream's `error_message`, outputs present) and prints one JSON line of exact figures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import httpx
import numpy as np

_REPORT = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, '
    .. '"status": %d, "timeout": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


def _post_script(body: Path, headers: Mapping[str, str]) -> str:
    """POST the file's bytes as they are (Lua strings are binary-safe) with `headers`."""
    return (
        f"local f = assert(io.open({json.dumps(str(body))}, 'rb'))\n"
        "wrk.method = 'POST'\n"
        "wrk.body = f:read('*a')\n"
        "f:close()\n"
        + "".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n" for k, v in headers.items())
        + _REPORT
    )


@dataclass(frozen=True)
class LoadResult:
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    requests: int
    errors: int
    """Socket errors plus non-2xx/3xx answers; a run with errors is not comparable."""
    client_cpu: float
    """The load generator's CPU time over the run's wall time (1.0 = one core busy)."""

    def to_dict(self) -> dict[str, float | int]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("wrk is not installed: apt-get install -y wrk")
    return path


def h2load_path() -> str:
    path = shutil.which("h2load")
    if path is None:
        raise SystemExit("h2load is not installed: apt-get install -y nghttp2-client")
    return path


_JSON_POST = {"Content-Type": "application/json"}

STEADY_WARMUP_S = 10.0
"""`steady_load`'s warm-up: several latencies of the slowest zoo model served at 8 connections."""


def _run(argv: list[str], out: Path) -> tuple[str, int, float, float]:
    """Run a load generator: its output, exit code, CPU seconds used and wall-clock seconds."""
    started = time.monotonic()
    with out.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall_s = time.monotonic() - started
    cpu_s = usage.ru_utime + usage.ru_stime
    return out.read_text(errors="replace"), os.waitstatus_to_exitcode(status), cpu_s, wall_s


def run_wrk(
    url: str,
    connections: int,
    seconds: float,
    threads: int,
    body: Path | None = None,
    headers: Mapping[str, str] = _JSON_POST,
) -> LoadResult:
    """Load `url` for `seconds` (POST `body` with `headers`, or GET when None); summarise it."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "load.lua"
        script.write_text(_post_script(body, headers) if body is not None else _REPORT)
        argv = [
            wrk_path(), f"-t{min(threads, connections)}", f"-c{connections}",
            f"-d{max(1, round(seconds))}s", "--timeout", "10s", "--latency",
            "-s", str(script), url,
        ]  # fmt: skip
        text, code, cpu_s, _ = _run(argv, Path(tmp) / "wrk.out")
    line = next((ln for ln in text.splitlines() if ln.startswith("WRK_JSON ")), None)
    if code != 0 or line is None:
        raise RuntimeError(f"wrk failed ({code}): {' '.join(argv)}\n{text}")
    r = json.loads(line.removeprefix("WRK_JSON "))
    duration_s = r["duration_us"] / 1e6
    errors = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
    return LoadResult(
        rps=r["requests"] / duration_s,
        p50_ms=r["p50_us"] / 1000,
        p90_ms=r["p90_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        requests=r["requests"],
        errors=errors,
        client_cpu=cpu_s / duration_s,
    )


_H2_FINISHED = re.compile(r"^finished in [\d.]+m?s, ([\d.]+) req/s", re.MULTILINE)
_H2_REQUESTS = re.compile(
    r"^requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, \d+ failed, "
    r"\d+ errored, (\d+) timeout",
    re.MULTILINE,
)


def run_h2load(
    url: str,
    clients: int,
    streams: int,
    body: Path,
    headers: Mapping[str, str],
    threads: int = 1,
    seconds: float | None = None,
    requests: int | None = None,
) -> LoadResult:
    """POST `body` with `headers` to `url` over HTTP/2 (h2c, prior knowledge) from `clients`
    connections of `streams` concurrent streams each, for `seconds` or exactly `requests` requests.

    `requests` is the number answered; `errors` those answered with a status other than 2xx/3xx,
    reset or timed out (as wrk counts them). h2load's own warm-up is not used: a caller warms up
    with a separate run, so that the server's count over a measured run can be compared to it.
    """
    if (seconds is None) == (requests is None):
        raise ValueError("give either seconds or requests")
    amount = ["-D", str(max(1, round(seconds)))] if seconds is not None else ["-n", str(requests)]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "requests.tsv"
        argv = [
            h2load_path(), "-c", str(clients), "-m", str(streams),
            "-t", str(min(threads, clients)), *amount, "-d", str(body), "--log-file", str(log),
            *(arg for k, v in headers.items() for arg in ("-H", f"{k}: {v}")), url,
        ]  # fmt: skip
        text, code, cpu_s, wall_s = _run(argv, Path(tmp) / "h2load.out")
        # One row per request: start (µs since the epoch), HTTP status, µs until the response ended.
        rows = np.loadtxt(log, dtype=np.int64, ndmin=2) if log.exists() else np.empty((0, 3))
    finished, counts = _H2_FINISHED.search(text), _H2_REQUESTS.search(text)
    if code != 0 or finished is None or counts is None or not len(rows):
        raise RuntimeError(f"h2load failed ({code}): {' '.join(argv)}\n{text}")
    done, succeeded, timeout = (int(v) for v in counts.groups())
    p50, p90, p99 = np.percentile(rows[:, 2], [50, 90, 99]) / 1000
    return LoadResult(
        rps=float(finished.group(1)),
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        requests=done,
        errors=done - succeeded + timeout,
        client_cpu=cpu_s / wall_s,
    )


GRPC_CLIENT = Path(__file__).resolve().parent / "grpc_client"
"""grpc_loadgen's source and Makefile; it builds into build/grpc_client/ at the repository root."""
GRPC_LOADGEN = GRPC_CLIENT.parent.parent / "build" / "grpc_client" / "grpc_loadgen"
_BUILD_COMMANDS = {
    "make": "make",
    "c++": "g++",
    "pkg-config": "pkg-config",
    "protoc": "protobuf-compiler",
    "grpc_cpp_plugin": "protobuf-compiler-grpc",
}
_BUILD_LIBRARIES = {"grpc++": "libgrpc++-dev", "protobuf": "libprotobuf-dev"}
"""pkg-config modules -> the Debian packages that provide them."""


@cache
def grpc_loadgen_path() -> str:
    """grpc_loadgen, built (or rebuilt after its source or the proto changed) on the first call;
    raises SystemExit naming the Debian packages to install when the build tools are missing."""
    missing = [pkg for command, pkg in _BUILD_COMMANDS.items() if shutil.which(command) is None]
    if shutil.which("pkg-config") is not None:
        missing += [
            pkg
            for module, pkg in _BUILD_LIBRARIES.items()
            if subprocess.run(["pkg-config", "--exists", module], check=False).returncode != 0
        ]
    else:
        missing += _BUILD_LIBRARIES.values()
    if missing:
        raise SystemExit(
            "building benchmarks/grpc_client needs Debian packages that are not installed: "
            f"apt-get install -y {' '.join(missing)}"
        )
    build = subprocess.run(
        ["make", "-s", "-C", str(GRPC_CLIENT)], capture_output=True, text=True, check=False
    )
    if build.returncode != 0 or not GRPC_LOADGEN.exists():
        raise SystemExit(
            f"building benchmarks/grpc_client failed ({build.returncode}):\n"
            f"{build.stdout}{build.stderr}"
        )
    return str(GRPC_LOADGEN)


@dataclass(frozen=True)
class GrpcLoadResult(LoadResult):
    total_ok: int
    """Successes over grpc_loadgen's whole run: warm-up, measured window and the drain after it.
    It waits for every request it sent, so the server answered exactly total_ok + total_errors."""
    total_errors: int


def run_grpc_loadgen(
    address: str,
    mode: str,
    concurrency: int,
    request: Path,
    seconds: float | None = None,
    requests: int | None = None,
    warmup: float = 0.0,
    threads: int = 1,
    channels: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> GrpcLoadResult:
    """`concurrency` closed-loop clients of the gRPC inference service at `address`, each with one
    request outstanding: back-to-back ModelInfer calls (`mode` "unary") or one ModelStreamInfer
    call writing the next message once the last is answered ("stream"). `request` holds a
    serialized ModelInferRequest (no gRPC framing). Runs `warmup` then `seconds` (measured), or
    exactly `requests` requests, from `threads` threads over `channels` connections (default: one
    per client). `client_cpu` is grpc_loadgen's own figure over the measured window.
    """
    if (seconds is None) == (requests is None):
        raise ValueError("give either seconds or requests")
    if mode not in ("unary", "stream"):
        raise ValueError(f"mode must be 'unary' or 'stream', not {mode!r}")
    if seconds is not None:
        amount = ["--seconds", f"{seconds:g}", "--warmup", f"{warmup:g}"]
    else:
        amount = ["--requests", str(requests)]
    argv = [
        grpc_loadgen_path(), "--address", address, "--mode", mode,
        "--concurrency", str(concurrency), *amount, "--request", str(request),
        "--threads", str(threads), "--channels", str(channels or concurrency),
        *(arg for k, v in (metadata or {}).items() for arg in ("--metadata", f"{k}: {v}")),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        text, code, _, _ = _run(argv, Path(tmp) / "grpc_loadgen.out")
    line = next((ln for ln in reversed(text.splitlines()) if ln.startswith('{"rps"')), None)
    if code != 0 or line is None:
        raise RuntimeError(f"grpc_loadgen failed ({code}): {' '.join(argv)}\n{text}")
    r = json.loads(line)
    return GrpcLoadResult(
        rps=float(r["rps"]),
        p50_ms=float(r["p50_ms"]),
        p90_ms=float(r["p90_ms"]),
        p99_ms=float(r["p99_ms"]),
        requests=int(r["requests"]),
        errors=int(r["errors"]),
        client_cpu=float(r["client_cpu"]),
        total_ok=int(r["total_ok"]),
        total_errors=int(r["total_errors"]),
    )


@dataclass(frozen=True)
class Run:
    """One measured run: the load generator's figures and what the server did meanwhile."""

    load: LoadResult
    server_cpu: float
    """The server's CPU time over the run's wall time (2.0 = two cores busy)."""
    mean_batch: float | None
    """Requests per model call (scriptserve only, from its batch-size histogram)."""

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            **self.load.to_dict(),
            "server_cpu": round(self.server_cpu, 3),
            "mean_batch": None if self.mean_batch is None else round(self.mean_batch, 2),
        }


def steady_load(
    url: str,
    connections: int,
    warmup_s: float,
    seconds: float,
    body: bytes,
    headers: Mapping[str, str],
) -> LoadResult:
    """POST `body` on `connections` keep-alive connections, one request outstanding on each,
    for `warmup_s` then `seconds`; the figures are those of the answers that arrive in the
    second part (see the module). A non-2xx answer or a failed request counts as an error."""
    start = time.monotonic()
    opens, closes = start + warmup_s, start + warmup_s + seconds
    latencies: list[list[float]] = [[] for _ in range(connections)]
    errors = [0] * connections

    def client(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < closes:
                sent = time.monotonic()
                try:
                    ok = http.post(url, content=body, headers=dict(headers)).is_success
                except httpx.HTTPError:
                    ok = False
                answered = time.monotonic()
                if opens <= answered <= closes:
                    if ok:
                        latencies[i].append(answered - sent)
                    else:
                        errors[i] += 1

    cpu = time.process_time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu_s = time.process_time() - cpu
    answered = np.array([x for per in latencies for x in per]) * 1000
    if answered.size == 0:
        raise RuntimeError(f"no answer from {url} within the {seconds:g} s window")
    p50, p90, p99 = (float(v) for v in np.percentile(answered, [50, 90, 99]))
    return LoadResult(
        rps=answered.size / seconds,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        requests=int(answered.size),
        errors=sum(errors),
        client_cpu=cpu_s / (time.monotonic() - start),
    )
