"""haproxy in front of the replicas: its configuration, and haproxy itself as a child process
whose stats socket says what it thinks of each replica."""

from __future__ import annotations

import contextlib
import csv
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from benchmarks.servers import free_port

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
