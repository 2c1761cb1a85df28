"""A real `scriptserve serve` process on free loopback ports, for integration tests.

A server is `python -m scriptserve serve ...` as a user starts it, except that the interpreter
is not started afresh for each: a fork server (multiprocessing's, started once per test run)
has imported what every server imports (torch, the server, the TorchScript backend), and each
server is forked from it, then runs the command's own `main` with the test's arguments,
environment and working directory, its output in its log file, its exit code its own. That
import is about 3 s of CPU a server, a quarter of the suite's CPU on 2 cores. A test that
gives its own `command` (an installed environment's `scriptserve`), or asks for `fresh`, runs
it as a process of its own, as does every server when SCRIPTSERVE_TEST_FRESH_SERVERS=1.
`run_command` runs the package's other commands (`scriptserve predict`, `model-archiver`) the
same way.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from multiprocessing.process import BaseProcess
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


_PRELOAD = [
    "torch",
    "scriptserve.server.cli",
    "scriptserve.server.app",
    "scriptserve.handlers.backends.torchscript",
    "uvloop",
    "pydantic.v1",
    "serving",
]
"""What the fork server imports once, for every server forked from it (`pydantic.v1`: FastAPI
imports it when it builds the first route, about 0.1 s of a forked server's 0.85 s start)."""
_forked: set[ForkedServer] = set()


def _fork_context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _as_started(env: dict[str, str], cwd: str | None, out: str, err: str) -> None:
    """In a forked child: the environment, folder and output files of a process started with
    them (standard output to `out`, standard error to `err`, appended)."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR as the test set it, not as the fork server found it
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)


def _exit_with(run: Callable[[], int | None]) -> None:
    """End a forked child as the interpreter ends a command: its exit code is what `run`
    returns, and the exit functions run (a forked child skips them)."""
    try:
        code = run()
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)


def _serve(argv: list[str], env: dict[str, str], cwd: str | None, log: str) -> None:
    """In the forked server: the `scriptserve` command's own start, as `python -m scriptserve`
    runs it, with the test's environment, folder and output file."""
    import scriptserve
    from scriptserve.server.cli import main

    _as_started(env, cwd, log, log)
    sys.argv = [str(Path(scriptserve.__file__).with_name("__main__.py")), *argv]  # as `-m` sets it
    _exit_with(main)


def _command(
    script: str, argv: list[str], env: dict[str, str], cwd: str | None, out: str, err: str
) -> None:
    """In the forked child: the console script `script`'s run, as its installed wrapper starts
    it (`sys.argv[0]` its name, the exit code what its entry function returns)."""
    (found,) = entry_points(group="console_scripts", name=script)
    entry = found.load()
    _as_started(env, cwd, out, err)
    sys.argv = [script, *argv]
    _exit_with(entry)


def run_command(
    script: str,
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """`script args...`, one of the package's console scripts (`scriptserve`, `model-archiver`),
    as `subprocess.run(..., capture_output=True, text=True)` runs it, but forked from the fork
    server, which has torch imported: about 0.2 s a command instead of 1.5-2 s. A process of
    its own all the same: its exit code, its standard output and error, its environment (`env`,
    else this process's) and folder (`cwd`). With SCRIPTSERVE_TEST_FRESH_SERVERS=1, the installed
    script itself runs."""
    if os.environ.get("SCRIPTSERVE_TEST_FRESH_SERVERS") == "1":
        return subprocess.run(
            [script, *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=cwd,
        )
    with tempfile.TemporaryDirectory(prefix="scriptserve-command-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        out.touch()
        err.touch()
        given = dict(os.environ if env is None else env)
        where = None if cwd is None else str(cwd)
        passed = (script, list(args), given, where, str(out), str(err))
        process = _fork_context().Process(target=_command, args=passed, name=script)
        process.start()
        process.join(timeout_s)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([script, *args], timeout_s)
        return subprocess.CompletedProcess(
            [script, *args], process.exitcode, out.read_text(), err.read_text()
        )


class ForkedServer:
    """A forked server, as the tests use a `subprocess.Popen`: `pid`, `poll`, `wait`,
    `send_signal`, `terminate`, `kill`, `returncode` (negative: the signal that ended it)."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process
        self.pid = process.pid
        _forked.add(self)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0)
        _forked.discard(self)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@atexit.register
def _stop_forked() -> None:
    """Servers a test left running end with the test run (multiprocessing would wait for them)."""
    for server in list(_forked):
        server.terminate()
    for server in list(_forked):
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


class ServerProcess:
    """Start with `start()`; `url`, `mgmt` and `metrics_url` are the three base URLs."""

    def __init__(
        self,
        store: Path,
        *args: str,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
        cwd: Path | None = None,
        fresh: bool = False,
    ) -> None:
        """`command` runs the server (default: this interpreter's `-m scriptserve`, forked from
        the fork server), in `cwd`; `fresh` starts the default command as a process of its own:
        for a test of what the server imports (a forked one has torch already), or of its
        resident memory (a forked one maps the fork server's pages as it touches them, which
        moves its resident size while it runs)."""
        self.fresh = (
            fresh or command is not None or os.environ.get("SCRIPTSERVE_TEST_FRESH_SERVERS") == "1"
        )
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
        self.proc: subprocess.Popen[bytes] | ForkedServer | None = None

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
            if self.fresh:
                self.proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd
                )
        if not self.fresh:
            cwd = None if self.cwd is None else str(self.cwd)
            args = (cmd[len(self.command) :], env, cwd, str(self.log))
            process = _fork_context().Process(target=_serve, args=args, name="scriptserve")
            process.start()
            self.proc = ForkedServer(process)
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
