"""SIGTERM (a time limit's `timeout`, the machine going away) stops the check: the step that ran
is recorded as stopped, what it started is ended, and the results file says how far it got."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.gpu_check.check import Check


class Stopped(BaseException):
    """SIGTERM arrived (a time limit's `timeout`, the machine going away): the step that runs
    is recorded as stopped and no further step runs. A BaseException, so that no step's own
    handling takes it for a failure of the step's; on its way out it ends what the step started
    (`subprocess.run` kills its command, a server's `with` block stops the server)."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def stoppable(check: Check, steps: Callable[[], int]) -> int:
    """What `steps()` returns, unless SIGTERM stops them: then the step that ran is recorded as
    stopped, what it started is ended, the results file says how far the check got, and the
    exit code is 143, as for a process SIGTERM ends."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return steps()
    except Stopped as stopped:
        _end_children()
        print(f"[gpu-check] {stopped}; results: {check.out}", flush=True)
        assert check.out is not None
        check.write(check.out)
        return 128 + signal.SIGTERM


def _end_children(grace_s: float = 10.0) -> None:
    """End the child processes a stopped step's own cleanup did not reach: a command that
    SIGTERM caught between its fork and its exec, before `subprocess.Popen` returned it to
    anything that would kill it. SIGTERM, then SIGKILL after `grace_s`; each one reaped."""
    children = _children()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pid in children:
        while not _reaped(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _reaped(pid):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped already (by a Popen that did get it)
        return True


def _children() -> list[int]:
    """This process's child processes, from /proc (no psutil: the check runs before it
    installs anything)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():  # state, then the parent
            found.append(int(entry.name))
    return found
