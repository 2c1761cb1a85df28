"""Servers under test as subprocesses on free loopback ports: scriptserve and the baselines."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import psutil

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now: each socket stays bound until all are chosen, so the
    kernel cannot hand one port out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class ServerProcess:
    """A server command that answers `ready_path` with 200 once started; a context manager."""

    def __init__(
        self, label: str, argv: list[str], port: int, ready_path: str, env: dict[str, str]
    ) -> None:
        self.label = label
        self.argv = argv
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.env = env
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_url: str | None = None
        """scriptserve's Prometheus endpoint, where batch sizes and request counts are read."""
        self.grpc_address: str | None = None
        """scriptserve's gRPC inference address (host:port)."""

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            self.argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self._wait_ready(timeout_s=120.0)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        output = self.output()
        self.stop()
        raise TimeoutError(f"{self.label} not ready within {timeout_s:g} s:\n{output}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process and its children so far."""
        assert self.proc is not None
        proc = psutil.Process(self.proc.pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            times = p.cpu_times()
            total += times.user + times.system
        return total

    def _metrics(self) -> str:
        assert self.metrics_url is not None
        with urllib.request.urlopen(self.metrics_url, timeout=5) as answer:
            return str(answer.read().decode())

    def batch_counts(self) -> tuple[float, float]:
        """(requests, batches) run so far, from scriptserve's batch-size histogram; else zeros."""
        if self.metrics_url is None:
            return 0.0, 0.0
        figures = {"sum": 0.0, "count": 0.0}
        for line in self._metrics().splitlines():
            name, _, value = line.partition(" ")
            for kind in figures:
                if name.startswith(f"scriptserve_batch_size_{kind}{{"):
                    figures[kind] += float(value)
        return figures["sum"], figures["count"]

    def request_counts(self) -> dict[tuple[str, str], int]:
        """(protocol, status) -> inference requests answered so far, over all models (scriptserve's
        `scriptserve_requests_total`); empty for a server without metrics."""
        if self.metrics_url is None:
            return {}
        counts: dict[tuple[str, str], int] = {}
        for line in self._metrics().splitlines():
            if line.startswith("scriptserve_requests_total{"):
                labels, _, value = line.partition("} ")
                pairs = dict(kv.split("=", 1) for kv in labels.split("{", 1)[1].split(","))
                key = (pairs["protocol"].strip('"'), pairs["status"].strip('"'))
                counts[key] = counts.get(key, 0) + round(float(value))
        return counts

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def scriptserve(
    label: str,
    store: Path,
    model: str,
    workers: int,
    intra_op_threads: int,
    max_batch_size: int,
    max_batch_delay_ms: int = 0,
) -> ServerProcess:
    """`python -m scriptserve serve` on free ports, batching with no delay unless one is given.

    Readiness is polled on the model itself: the server-wide /v2/health/ready answers 200 while
    the startup models are still being registered.
    """
    port, mgmt, metrics, grpc, grpc_mgmt = free_ports(5)
    argv = [
        sys.executable, "-m", "scriptserve", "serve",
        "--model-store", str(store), "--models", "all", "--device", "cpu",
        "--inference-address", f"127.0.0.1:{port}",
        "--management-address", f"127.0.0.1:{mgmt}",
        "--metrics-address", f"127.0.0.1:{metrics}",
        "--grpc-inference-address", f"127.0.0.1:{grpc}",
        "--grpc-management-address", f"127.0.0.1:{grpc_mgmt}",
        "--workers", str(workers), "--intra-op-threads", str(intra_op_threads),
        "--max-batch-size", str(max_batch_size), "--max-batch-delay", str(max_batch_delay_ms),
        "--log-level", "warning",
    ]  # fmt: skip
    server = ServerProcess(label, argv, port, f"/v2/models/{model}/ready", {})
    server.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    server.grpc_address = f"127.0.0.1:{grpc}"
    return server


def uvicorn_app(label: str, app: str, env: dict[str, str], factory: bool = False) -> ServerProcess:
    """A baseline app under uvicorn with scriptserve's HTTP stack (uvloop + httptools)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
        "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning",
        *(["--factory"] if factory else []),
    ]  # fmt: skip
    return ServerProcess(label, argv, port, "/", env)
