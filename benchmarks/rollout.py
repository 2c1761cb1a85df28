"""A rolling restart behind a real load balancer, under steady load, on loopback: does any
request fail, and how far does throughput dip?

    apt-get install -y haproxy
    python -m benchmarks.rollout [--replicas 2] [--seconds-per-phase 6] [--connections 16]

N replicas serve the scenario-A MLP archive (benchmarks/models.py), each with one worker so that
two fit two cores, behind haproxy (Debian's package, run in the foreground as a child) that
checks `/v2/health/ready`. A closed-loop client sends the scenario's request through haproxy
from a fixed number of workers and records every request's outcome: succeeded (200), failed
(any other status) or unanswered (a timeout or a connection error). After a warm phase and a
steady phase, each replica in turn gets SIGTERM, exits, is started again on the same ports and
waited for until haproxy marks it UP, followed by another steady phase.

Prints the per-second throughput, the steady throughput before the first restart, the lowest
1-s window during each restart (the dip), the counts, and writes them all to
benchmarks/results/rollout-<date>.json. Exits 1 when any request failed or went unanswered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import datetime as dt
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import cast

import httptools
import uvloop

from benchmarks import models, report
from benchmarks.servers import ServerProcess, free_port

RESULTS = Path(__file__).resolve().parent / "results"
READY_PATH = "/v2/health/ready"

# Which failed attempts haproxy resends, to another replica (`option redispatch 1`). An
# inference POST has no side effects, but a resend still runs the model twice if the first
# replica did run it, so only failures where the replica did not run the request are resent:
# - conn-failure: the connection was refused (the draining replica has closed its listener, or
#   the restarted one has not opened it yet): the request was never sent.
# - empty-response: the connection closed before any answer. During a drain this is the
#   keep-alive race: the replica closes an idle connection as haproxy sends a request on it,
#   or resets one still in its accept queue when the listener closes; neither request was read.
#   (A replica that crashes mid-request looks the same; for inference a rerun is harmless.)
# - 503: the server answers 503 only for requests it did not run (draining, queue full, model
#   not ready: server/errors.py); a draining replica answers 503 to a request that arrives on a
#   kept-alive connection after SIGTERM, before the health check has marked it DOWN.
# Not response-timeout: that request may still be running, and resending slow requests turns
# an overloaded replica into an overloaded pair. Not junk-response or 5xx other than 503: those
# say the request itself went wrong, and another replica would do the same.
RETRY_ON = "conn-failure empty-response 503"
NO_HAPROXY = "haproxy is not installed: apt-get install -y haproxy"
CHECK_INTERVAL_MS = 250
"""haproxy checks readiness this often: a draining replica is DOWN after 2 misses (0.5 s)."""


def haproxy_path() -> str | None:
    """Debian installs haproxy in /usr/sbin, which a non-root PATH may lack."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def haproxy_config(
    port: int,
    servers: dict[str, int],
    stats_socket: Path,
    balance: str = "leastconn",
    retry_on: str = RETRY_ON,
) -> str:
    """An HTTP front on 127.0.0.1:`port` for the replicas `servers` (name -> port)."""
    lines = "".join(f"    server {name} 127.0.0.1:{p}\n" for name, p in servers.items())
    return f"""\
global
    # One thread: the replicas need the cores more than the balancer.
    nbthread 1
    stats socket {stats_socket} mode 600 level admin
    log stdout format raw local0 info

defaults
    mode http
    log global
    # Only abnormal requests are logged (errors, and the ones retried or redispatched).
    option httplog
    option dontlog-normal
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    timeout check 1s

frontend inference
    bind 127.0.0.1:{port}
    default_backend replicas

backend replicas
    # leastconn: the next request goes to the replica with the fewest in flight, so one slowed
    # down (cold, or sharing its cores with a neighbour that is starting) gets less.
    balance {balance}
    # Readiness, not liveness: 503 until the models are loaded and again once draining.
    option httpchk GET {READY_PATH}
    # Up to 3 resends of a request that failed in one of the `retry-on` ways, each to another
    # replica than the last (redispatch on every retry, not only the last).
    retries 3
    option redispatch 1
    retry-on {retry_on}
    # A request can be resent only if haproxy held all of it when it sent it: wait for the body,
    # which clients may write after the headers (httpx does: without this, a 503 reached it).
    option http-buffer-request
    default-server check inter {CHECK_INTERVAL_MS} fall 2 rise 2
{lines}"""


class Balancer:
    """haproxy in the foreground (`-db`) as a child process; a context manager."""

    def __init__(self, servers: dict[str, int], balance: str, retry_on: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="scriptserve-haproxy-")
        self.stats_socket = Path(self._dir.name) / "stats.sock"
        self.config = haproxy_config(self.port, servers, self.stats_socket, balance, retry_on)
        self.servers = list(servers)
        self._log = Path(self._dir.name) / "haproxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Balancer:
        config = Path(self._dir.name) / "haproxy.cfg"
        config.write_text(self.config)
        binary = haproxy_path()
        if binary is None:
            raise RuntimeError(NO_HAPROXY)
        with self._log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        for name in self.servers:
            self.wait_for(name, "UP", timeout_s=30.0)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()

    def output(self) -> str:
        return self._log.read_text(errors="replace")[-4000:] if self._log.exists() else ""

    def stats(self) -> list[dict[str, str]]:
        """`show stat` from the stats socket: one row per frontend, backend and server."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2.0)
            sock.connect(str(self.stats_socket))
            sock.sendall(b"show stat\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        lines = b"".join(chunks).decode().splitlines()
        header = lines[0].removeprefix("# ").split(",")
        return list(csv.DictReader(lines[1:], fieldnames=header))

    def _backend_row(self, name: str) -> dict[str, str]:
        """The stats row of a server of the backend, or of the backend itself ("BACKEND")."""
        return next(r for r in self.stats() if r["pxname"] == "replicas" and r["svname"] == name)

    def status(self, server: str) -> str:
        """What haproxy thinks of `server`: UP, DOWN, or on its way ("DOWN 1/2", "UP 1/2")."""
        return self._backend_row(server)["status"]

    def counters(self) -> dict[str, int]:
        """The backend's retries and redispatches, and its answers by class, so far."""
        row = self._backend_row("BACKEND")
        keys = ("wretr", "wredis", "econ", "eresp", "hrsp_2xx", "hrsp_5xx")
        return {key: int(row[key] or 0) for key in keys}

    def wait_for(self, server: str, status: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(OSError):  # the socket is not there yet
                if self.status(server) == status:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"haproxy did not see {server} {status} within {timeout_s:g} s")


class Replica:
    """One scriptserve replica on fixed loopback ports, which it keeps across restarts."""

    def __init__(self, name: str, store: Path, server_args: tuple[str, ...] = ()) -> None:
        self.name = name
        self.port, self._mgmt, self._metrics, self._grpc, self._grpc_mgmt = (
            free_port() for _ in range(5)
        )
        self.argv = [
            sys.executable, "-m", "scriptserve", "serve", "--model-store", str(store),
            "--models", "all", "--device", "cpu",
            # Replicas share the store: the declarative mode records no snapshot there.
            "--snapshot-mode", "declarative",
            "--inference-address", f"127.0.0.1:{self.port}",
            "--management-address", f"127.0.0.1:{self._mgmt}",
            "--metrics-address", f"127.0.0.1:{self._metrics}",
            "--grpc-inference-address", f"127.0.0.1:{self._grpc}",
            "--grpc-management-address", f"127.0.0.1:{self._grpc_mgmt}",
            "--workers", "1", "--intra-op-threads", "1",
            "--max-batch-size", "32", "--max-batch-delay", "0", "--log-level", "warning",
            *server_args,
        ]  # fmt: skip
        self.process: ServerProcess | None = None

    def start(self) -> None:
        """Start the server and wait until it answers ready."""
        # The server sets torch's threads on the thread that loads the model; the worker thread
        # that runs it keeps OpenMP's default (the count is per thread: one per core), so MKL's
        # sgemm runs a team of two whose spin-waits collapse two replicas sharing two cores
        # (measured: 1,160 req/s together, 6,300 with this). This sets every thread's default.
        env = {"OMP_NUM_THREADS": "1"}
        process = ServerProcess(self.name, self.argv, self.port, READY_PATH, env)
        process.metrics_url = f"http://127.0.0.1:{self._metrics}/metrics"
        self.process = process.__enter__()

    def answered(self) -> int:
        """Inference requests this process has answered 200 (its own metrics)."""
        assert self.process is not None
        counts = self.process.request_counts()
        return sum(n for (_, status), n in counts.items() if status == "200")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@dataclass(frozen=True)
class Outcome:
    done_s: float
    """When the answer (or the error) came, in seconds since the load started."""
    kind: str
    """succeeded (a 200), failed (another status) or unanswered (a timeout, a lost connection)."""
    detail: str
    """The status code or the exception's name."""


class _Connection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection carrying one request at a time. Answers are parsed by
    httptools (llhttp, the parser the server runs too): a client in Python that builds request
    objects (httpx) tops out near 900 req/s on this machine, below what two replicas serve."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[tuple[int, bool]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._settle(exc)
            self.close()

    def on_message_complete(self) -> None:  # the parser's callback
        self._settle((self.parser.get_status_code(), self.parser.should_keep_alive()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._settle(exc or ConnectionResetError("closed before the answer was complete"))

    def _settle(self, result: tuple[int, bool] | Exception) -> None:
        if self.answer is None or self.answer.done():
            return
        if isinstance(result, Exception):
            self.answer.set_exception(result)
        else:
            self.answer.set_result(result)

    async def exchange(self, request: bytes) -> tuple[int, bool]:
        """Send `request` (all of it, in one write); the answer's status and whether the
        connection stays open."""
        if self.transport is None:
            raise ConnectionResetError("the connection is closed")
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.answer

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class CountingLoad:
    """Closed-loop POSTs of `body` to `url` from `connections` workers, each with one request
    outstanding on its own keep-alive connection, on an event loop in a thread of its own;
    every request's outcome is kept. `stop()` lets each worker finish the request it has in
    flight, so none is cut off."""

    def __init__(self, url: str, body: bytes, connections: int, timeout_s: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.request = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.connections, self.timeout_s = connections, timeout_s
        self.outcomes: list[Outcome] = []
        self.started = 0.0
        self.duration_s = 0.0
        self.cpu_s = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.started

    def __enter__(self) -> CountingLoad:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending, wait for the requests in flight; raises what broke the client."""
        self._stop.set()
        self._thread.join(self.timeout_s + 10)
        error, self.error = self.error, None  # raised once, not again by __exit__
        if error is not None:
            raise RuntimeError("the load generator failed") from error

    def _main(self) -> None:
        try:
            uvloop.run(self._run())
        except BaseException as exc:  # handed to the main thread by stop()
            self.error = exc

    async def _run(self) -> None:
        cpu = time.thread_time()
        await asyncio.gather(*(self._worker() for _ in range(self.connections)))
        self.duration_s = self.now()
        self.cpu_s = time.thread_time() - cpu

    async def _connect(self) -> _Connection:
        connect = asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        _, connection = await asyncio.wait_for(connect, self.timeout_s)
        return connection

    async def _worker(self) -> None:
        connection: _Connection | None = None
        while not self._stop.is_set():
            try:
                if connection is None or connection.transport is None:
                    connection = await self._connect()
                answer = connection.exchange(self.request)
                status, keep_alive = await asyncio.wait_for(answer, self.timeout_s)
            except (OSError, asyncio.TimeoutError, httptools.HttpParserError) as exc:
                # Refused, reset, closed early, timed out or garbled: no answer to count.
                self.outcomes.append(Outcome(self.now(), "unanswered", type(exc).__name__))
                if connection is not None:
                    connection.close()
                connection = None
                continue
            kind = "succeeded" if status == 200 else "failed"
            self.outcomes.append(Outcome(self.now(), kind, str(status)))
            if not keep_alive:
                connection.close()
                connection = None
        if connection is not None:
            connection.close()


@dataclass
class Restart:
    """One replica's SIGTERM and restart; times in seconds since the load started."""

    replica: str
    sigterm_s: float
    answered_before: int
    """Requests the old process had answered 200 when it got SIGTERM."""
    marked_down_s: float = math.nan
    exited_s: float = math.nan
    exit_code: int | None = None
    ready_s: float = math.nan
    up_s: float = math.nan
    """When haproxy had it UP again."""
    answered_after: int = 0
    """Requests the new process answered 200 by the end of the next steady phase."""


def restart(replica: Replica, balancer: Balancer, load: CountingLoad) -> Restart:
    """SIGTERM `replica`, wait for it to exit (haproxy marks it DOWN meanwhile), start it
    again on the same ports and wait until haproxy has it UP."""
    process = replica.process
    assert process is not None and process.proc is not None
    event = Restart(replica.name, load.now(), replica.answered())
    process.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60.0
    while math.isnan(event.marked_down_s) or event.exit_code is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{replica.name}: not DOWN and exited within 60 s of SIGTERM")
        if math.isnan(event.marked_down_s) and balancer.status(replica.name) == "DOWN":
            event.marked_down_s = load.now()
        if event.exit_code is None and process.proc.poll() is not None:
            event.exited_s, event.exit_code = load.now(), process.proc.returncode
        time.sleep(0.05)
    if event.exit_code != 0:
        raise RuntimeError(f"{replica.name} exited {event.exit_code}:\n{process.output()}")
    process.stop()  # it has exited: this closes its log
    replica.start()
    event.ready_s = load.now()
    balancer.wait_for(replica.name, "UP", timeout_s=30.0)
    event.up_s = load.now()
    return event


@dataclass
class Rollout:
    """What a run saw: every request's outcome, the restarts, and haproxy's counters."""

    outcomes: list[Outcome]
    duration_s: float
    steady_from_s: float
    """Where the warm phase ended."""
    restarts: list[Restart]
    haproxy: dict[str, int]
    client_cpu: float
    """The load generator's CPU time over the run (1.0 = one core busy)."""
    counts: dict[str, int] = field(init=False)
    series: list[int] = field(init=False)
    """Requests answered 200 in each whole second of the run."""

    def __post_init__(self) -> None:
        self.counts = {"total": len(self.outcomes), "succeeded": 0, "failed": 0, "unanswered": 0}
        self.counts.update(Counter(o.kind for o in self.outcomes))
        self.series = [0] * int(self.duration_s)
        for o in self.outcomes:
            if o.kind == "succeeded" and int(o.done_s) < len(self.series):
                self.series[int(o.done_s)] += 1

    def mean_rate(self, start_s: float, end_s: float) -> float:
        """Mean req/s over the whole seconds that lie within [start_s, end_s]."""
        inside = self.series[math.ceil(start_s) : math.floor(end_s)]
        return sum(inside) / len(inside) if inside else math.nan

    def dip(self, event: Restart) -> int:
        """The lowest 1-s window that overlaps the restart, from SIGTERM until UP again."""
        windows = self.series[math.floor(event.sigterm_s) : math.ceil(event.up_s)]
        return min(windows, default=0)

    def steady_before(self) -> float:
        end = self.restarts[0].sigterm_s if self.restarts else self.duration_s
        return self.mean_rate(self.steady_from_s, end)

    def figures(self) -> list[dict[str, float]]:
        """Per restart: the dip (req/s, and as a fraction of the steady rate before the first
        restart) and the mean rate from UP again until the next SIGTERM or the end."""
        steady = self.steady_before()
        ends = [e.sigterm_s for e in self.restarts[1:]] + [self.duration_s]
        return [
            {
                "dip_rps": self.dip(event),
                "dip_fraction": self.dip(event) / steady,
                "steady_after_rps": self.mean_rate(event.up_s, end),
            }
            for event, end in zip(self.restarts, ends, strict=True)
        ]


def rollout(
    store: Path,
    model: str,
    body: bytes,
    *,
    replicas: int = 2,
    warm_s: float = 2.0,
    phase_s: float = 5.0,
    connections: int = 16,
    balance: str = "leastconn",
    retry_on: str = RETRY_ON,
    server_args: tuple[str, ...] = (),
) -> Rollout:
    """Run the whole time line on the archives in `store`, loading `model` with `body`."""
    fleet = [Replica(f"r{i + 1}", store, server_args) for i in range(replicas)]
    with contextlib.ExitStack() as stack:
        for replica in fleet:
            stack.callback(replica.stop)
        with ThreadPoolExecutor(len(fleet)) as pool:  # the replicas load at the same time
            list(pool.map(Replica.start, fleet))
        balancer = stack.enter_context(Balancer({r.name: r.port for r in fleet}, balance, retry_on))
        load = stack.enter_context(
            CountingLoad(f"{balancer.url}/predictions/{model}", body, connections)
        )
        time.sleep(warm_s + phase_s)  # the load runs: this is the warm and steady phase
        events: list[Restart] = []
        for replica in fleet:
            events.append(restart(replica, balancer, load))
            time.sleep(phase_s)
            events[-1].answered_after = replica.answered()
        load.stop()
        counters = balancer.counters()
    duration = load.duration_s
    return Rollout(load.outcomes, duration, warm_s, events, counters, load.cpu_s / duration)


def timeline(result: Rollout, per_line: int = 15) -> list[str]:
    """The per-second series, `per_line` seconds a line, with `|r1` before the second in which
    r1 got SIGTERM and `^r1` before the one in which haproxy had it UP again."""
    marks: dict[int, list[str]] = {}
    for event in result.restarts:
        marks.setdefault(int(event.sigterm_s), []).append(f"|{event.replica}")
        marks.setdefault(int(event.up_s), []).append(f"^{event.replica}")
    lines = []
    for start in range(0, len(result.series), per_line):
        cells = [
            " ".join([*marks.get(second, []), str(result.series[second])])
            for second in range(start, min(start + per_line, len(result.series)))
        ]
        lines.append(f"  {start:>3} s: " + " ".join(cells))
    return lines


def summary(result: Rollout) -> list[str]:
    lines = [f"steady before the first restart: {result.steady_before():.0f} req/s"]
    for event, figures in zip(result.restarts, result.figures(), strict=True):
        at = event.sigterm_s
        lines.append(
            f"{event.replica}: SIGTERM at {at:.1f} s; haproxy DOWN +{event.marked_down_s - at:.2f} "
            f"s, exited +{event.exited_s - at:.2f} s (code {event.exit_code}), ready again "
            f"+{event.ready_s - at:.2f} s, haproxy UP +{event.up_s - at:.2f} s; lowest 1-s "
            f"window {figures['dip_rps']:.0f} req/s ({figures['dip_fraction']:.2f} of steady); "
            f"then {figures['steady_after_rps']:.0f} req/s; answered 200: "
            f"{event.answered_before} before SIGTERM, {event.answered_after} after the restart"
        )
    c, h = result.counts, result.haproxy
    lines.append(
        f"requests: {c['total']} total, {c['succeeded']} succeeded, {c['failed']} failed, "
        f"{c['unanswered']} unanswered"
    )
    lines.append(
        f"haproxy: {h['wretr']} retries, {h['wredis']} redispatches, {h['econ']} connection "
        f"errors, {h['eresp']} response errors, {h['hrsp_5xx']} 5xx answers to clients; "
        f"load generator CPU {result.client_cpu:.2f}"
    )
    return lines


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
        "benchmark": "rollout", "started": started.isoformat(timespec="seconds"),
        "replicas": args.replicas, "connections": args.connections,
        "warm_seconds": args.warm_seconds, "seconds_per_phase": args.seconds_per_phase,
        "haproxy": {"balance": args.balance, "retry_on": args.retry_on,
                    "check_interval_ms": CHECK_INTERVAL_MS, "counters": result.haproxy},
        "counts": result.counts, "steady_rps": _finite(result.steady_before()),
        "restarts": restarts, "per_second": result.series, "not_succeeded": problems[:100],
        "client_cpu": result.client_cpu,
    }  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--seconds-per-phase", type=float, default=6.0,
                   help="steady load before the first restart and after each one")  # fmt: skip
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
            store, model.name, model.body.read_bytes(), replicas=args.replicas,
            warm_s=args.warm_seconds, phase_s=args.seconds_per_phase,
            connections=args.connections, balance=args.balance, retry_on=args.retry_on,
        )  # fmt: skip
    print("requests answered 200 per second:")
    print("\n".join(timeline(result)))
    print("\n".join(summary(result)))
    host = {"cpus": os.cpu_count(), "load_average_before": load_before,
            "load_average_after": os.getloadavg()}  # fmt: skip
    print(report.host_line(host))
    out = args.output or RESULTS / f"rollout-{started:%Y-%m-%dT%H%M}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.compact_json({**document(result, args, started), "host": host}))
    print(f"results: {out}")
    lost = result.counts["failed"] + result.counts["unanswered"]
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
