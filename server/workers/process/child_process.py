"""One worker process as the server sees it: start it, talk to it, end it, say how it ended."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from time import monotonic
from typing import Any

from scriptserve.server.workers.process import fork_server
from scriptserve.server.workers.process.child import ChildSpec, ServerStreams, child_main


class WorkerGone(Exception):
    """The worker process ended; the message says how."""


class WorkerHung(Exception):
    """The worker process did not answer in time."""


def exit_description(exitcode: int | None) -> str:
    """How a process ended, in words: 'killed by signal 9 (SIGKILL)', 'out of memory', ..."""
    if exitcode is None:
        return "stopped answering"
    if exitcode == 137:  # 128 + SIGKILL: what container runtimes report for an OOM kill
        return "out of memory: exit code 137"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-exitcode} ({name})"
    return f"exited with code {exitcode}"


@dataclass(eq=False)
class Child:
    """A started worker process and the server's end of its pipe."""

    process: BaseProcess
    conn: Connection
    _how: str | None = field(default=None, init=False)

    def send(self, message: tuple[Any, ...]) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WorkerGone(self.ended()) from exc

    def receive(self, deadline: float) -> tuple[Any, ...]:
        """The next message; WorkerGone when the process ends first, WorkerHung at `deadline`."""
        sentinel = self.process.sentinel
        while True:
            remaining = deadline - monotonic()
            if remaining <= 0:
                raise WorkerHung()
            ready = wait([self.conn, sentinel], remaining)
            if self.conn in ready:
                try:
                    message: tuple[Any, ...] = self.conn.recv()
                    return message
                except (EOFError, OSError):
                    ready.append(sentinel)
            if sentinel in ready:
                raise WorkerGone(self.ended())

    def ended(self) -> str:
        """How the process ended, in words, once its sentinel says it has. The fork server
        reports the exit of each worker it forked: if it goes away, each of them looks ended
        (exit code 255) although it may still run, in a handler call or idle. Such a worker is
        killed here, so that none outlives its slot or runs beside its replacement."""
        if self._how is None:
            self.process.join(5.0)
            pid = self.process.pid
            if self.process.exitcode == 255 and pid is not None and _exists(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self._how = "lost with its fork server, which ended"
            else:
                self._how = exit_description(self.process.exitcode)
        return self._how

    def end(self, grace_s: float) -> None:
        """Ask the process to exit; kill it (SIGKILL) after `grace_s`."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("stop",))
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        else:
            self.ended()  # kills a worker its fork server left running
        self.conn.close()


def _exists(pid: int) -> bool:
    """A process of that id exists (a worker's exit is reported, by its fork server, only once
    the worker is reaped: its id is then gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the id
        return False
    return True


def spawn(spec: ChildSpec, name: str) -> Child:
    """Start a worker process (it loads its handler, then says `ready` or `error`)."""
    forks = fork_server.context()
    ours, theirs = forks.Pipe(duplex=True)
    args = (theirs, spec, ServerStreams())
    process = forks.Process(target=child_main, args=args, name=name, daemon=True)
    process.start()
    theirs.close()
    return Child(process, ours)
