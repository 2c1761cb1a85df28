"""Slow test prerequisites built in the background while other tests run.

Building the container image (debootstrap, a wheelhouse, `buildah bud`) and the packaging
tests' fresh virtual environment take minutes, almost all of it in child processes waiting on
disks and downloads; the zoo's compiles and the shared training runs (trainruns.py) take
minutes and half minutes of CPU, in a child process each. `start` runs such a job on a thread
as soon as collection shows a test that will need it; the fixture then calls `result`, which
waits for the job (or runs it there and then when nothing started it). The thread lowers its
own scheduling priority before it starts any process, and children inherit it: timed tests
running meanwhile keep the CPU.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

log = logging.getLogger("tests.headstart")

T = TypeVar("T")

NICENESS = 15
_jobs: dict[str, Future[object]] = {}
_lock = threading.Lock()


def _run(name: str, job: Callable[[], object], future: Future[object]) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except OSError as error:  # not permitted: run at normal priority
        log.info("headstart %s runs at normal priority: %s", name, error)
    try:
        future.set_result(job())
    except BaseException as error:
        future.set_exception(error)


def start(name: str, job: Callable[[], object]) -> None:
    """Begin `job` on a background thread, once per name."""
    with _lock:
        if name in _jobs:
            return
        future: Future[object] = Future()
        _jobs[name] = future
    threading.Thread(
        target=_run, args=(name, job, future), name=f"headstart-{name}", daemon=True
    ).start()


def result(name: str, job: Callable[[], T], timeout_s: float = 1800) -> T:
    """What `job` returned: from its head start if one was begun, else run here."""
    with _lock:
        future = _jobs.get(name)
    if future is None:
        return job()
    value = future.result(timeout=timeout_s)
    return value  # type: ignore[return-value]


def started(name: str) -> bool:
    with _lock:
        return name in _jobs
