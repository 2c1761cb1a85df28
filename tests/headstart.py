"""Slow test prerequisites built in the background while other tests run.

Building the container image (debootstrap, a wheelhouse, `buildah bud`) and the packaging
tests' fresh virtual environment take minutes, almost all of it in child processes waiting on
disks and downloads; the zoo's compiles and the shared training runs (trainruns.py) take
minutes and half minutes of CPU, in a child process each. `start` runs such a job on a thread
as soon as collection shows a test that will need it; the fixture then calls `result`, which
waits for the job (or runs it there and then when nothing started it). The thread lowers its
own scheduling priority before it starts any process, and children inherit it: timed tests
running meanwhile keep the CPU. `summary` says, at the end of the run, how long each took and
how long the tests waited for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

log = logging.getLogger("tests.headstart")

T = TypeVar("T")

NICENESS = 15
SERIAL_NICENESS = 10
"""For a head start that is one chain of steps whose tests take long (the image: a rootfs, then
`buildah bud`; the `.pt2` archives, one compile after another, whose tests compile more): three
times the CPU share of the others when they compete (Linux weighs nice 10 at 110, nice 15 at
36), so that it ends while they still run and its tests run beside them, not alone after them
with one core idle; the tests, at nice 0 (1,024), keep the CPU all the same."""
TIMEOUT_S = 1800
"""The longest a fixture waits for a head start, and the bound on a head start's own commands."""
_jobs: dict[str, Future[object]] = {}
_lock = threading.Lock()
_took: dict[str, tuple[float, float]] = {}
"""Each job's start and end (time.monotonic())."""
_waited: dict[str, float] = {}
"""The seconds a fixture waited for each job's result."""
_began = time.monotonic()


def _run(name: str, job: Callable[[], object], future: Future[object], niceness: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except OSError as error:  # not permitted: run at normal priority
        log.info("headstart %s runs at normal priority: %s", name, error)
    began = time.monotonic()
    try:
        future.set_result(job())
    except BaseException as error:
        future.set_exception(error)
    finally:
        _took[name] = (began, time.monotonic())


def start(name: str, job: Callable[[], object], niceness: int = NICENESS) -> None:
    """Begin `job` on a background thread, once per name, at `niceness`."""
    with _lock:
        if name in _jobs:
            return
        future: Future[object] = Future()
        _jobs[name] = future
    threading.Thread(
        target=_run, args=(name, job, future, niceness), name=f"headstart-{name}", daemon=True
    ).start()


def result(name: str, job: Callable[[], T], timeout_s: float = TIMEOUT_S) -> T:
    """What `job` returned: from its head start if one was begun, else run here."""
    with _lock:
        future = _jobs.get(name)
    if future is None:
        return job()
    began = time.monotonic()
    try:
        value = future.result(timeout=timeout_s)
    finally:
        _waited[name] = _waited.get(name, 0.0) + time.monotonic() - began
    return value  # type: ignore[return-value]


def started(name: str) -> bool:
    with _lock:
        return name in _jobs


def summary() -> list[str]:
    """A line per head start: when it began and ended (seconds from the session's start), and
    how long the tests waited for it (what it added to the run's time)."""
    lines = []
    for name in sorted(_took, key=lambda n: _took[n][0]):
        began, ended = _took[name]
        waited = _waited.get(name, 0.0)
        lines.append(
            f"{name}: {ended - began:.0f} s, from {began - _began:.0f} s to {ended - _began:.0f} s;"
            f" the tests waited {waited:.0f} s for it"
        )
    return lines
