"""A real `scriptserve serve` process on free loopback ports, for integration tests."""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_PORTS = range(max(1024, _ephemeral_low() - 12000), _ephemeral_low())
"""Ports below the range the kernel hands to outgoing connections: between picking a port and
the server binding it, a client connection of the suite could otherwise take it as its own
local port (a replica test once failed to start with "Address already in use")."""
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never the same one twice in this process."""
    while True:
        port = random.choice(_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


class ServerProcess:
    """Start with `start()`; `url`, `mgmt` and `metrics_url` are the three base URLs."""

    def __init__(
        self,
        store: Path,
        *args: str,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """`command` runs the server (default: this interpreter's `-m scriptserve`), in `cwd`."""
        self.command = command or [sys.executable, "-m", "scriptserve"]
        self.cwd = cwd
        self.store = store
        self.args = list(args)
        self.management_key = secrets.token_urlsafe(24)
        self.env = {"SCRIPTSERVE_MANAGEMENT_KEY": self.management_key, **(env or {})}
        self.ports = tuple(free_port() for _ in range(5))
        self.url = f"http://127.0.0.1:{self.ports[0]}"
        self.mgmt = f"http://127.0.0.1:{self.ports[1]}"
        self.metrics_url = f"http://127.0.0.1:{self.ports[2]}"
        self.grpc = f"127.0.0.1:{self.ports[3]}"
        self.grpc_mgmt = f"127.0.0.1:{self.ports[4]}"
        self.log = store.parent / f"server-{self.ports[0]}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def mgmt_headers(self) -> dict[str, str]:
        """Headers that authorize a management call (REST; gRPC takes the same as metadata)."""
        return {"Authorization": f"Bearer {self.management_key}"}

    def start(self, wait_ready: bool = True, timeout_s: float = 60.0) -> ServerProcess:
        cmd = [
            *self.command, "serve",
            "--model-store", str(self.store),
            "--inference-address", f"127.0.0.1:{self.ports[0]}",
            "--management-address", f"127.0.0.1:{self.ports[1]}",
            "--metrics-address", f"127.0.0.1:{self.ports[2]}",
            "--grpc-inference-address", self.grpc,
            "--grpc-management-address", self.grpc_mgmt,
            *self.args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd
            )
        try:
            self.wait(lambda c: c.get(f"{self.url}/v2/health/live").status_code == 200, timeout_s)
            if wait_ready:
                ready = f"{self.url}/v2/health/ready"
                self.wait(lambda c: c.get(ready).status_code == 200, timeout_s)
        except BaseException:
            self.stop()  # a server that never came up must not outlive the test
            raise
        return self

    def wait(self, check: object, timeout_s: float = 60.0) -> None:
        """Poll `check(client)` until it is true or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
                try:
                    if check(client):  # type: ignore[operator]
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"server not ready in {timeout_s}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
