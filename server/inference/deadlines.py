"""The deadlines of the data plane's queued requests, kept by one timer.

A request not answered by its deadline is withdrawn from its model's queue and answered 504,
whatever its worker does (`expire`). Each request could have a timer of its own, set when it is
queued and cancelled when it is answered; with uvloop that pair costs the event loop about as much
as a quarter of the data plane's own work a request. Here the deadlines wait in one heap, in the
order they fall due, and one timer is set for the earliest: an answered request's entry is only
marked, and dropped when it reaches the top or when marked entries outnumber the others (as
asyncio's own loop keeps its cancelled timers). A request is expired at its deadline, as by a timer
of its own.

    deadlines = Deadlines()
    entry = deadlines.add(job, batcher, budget_s)   # when queued
    deadlines.remove(entry)                          # when answered (or withdrawn)
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any

from scriptserve.server.errors import DeadlineExceeded
from scriptserve.server.workers.batching import DynamicBatcher, Job

Entry = list[Any]
"""[deadline, sequence, job or None once removed, batcher, budget_s]: compared by deadline,
then by the order of arrival (never by the job)."""
_RESOLUTION_S = 0.001
"""The event loop's timers fire up to a millisecond early (uvloop's clock counts milliseconds):
a deadline that near is due, else the timer would be set again and again until the clock
reaches it."""
_COMPACT_AT = 256
"""Removed entries the heap may hold before they are dropped at once (when they also outnumber
the waiting ones)."""


class Deadlines:
    """The deadlines of the requests in flight, on the event loop's clock (see the module)."""

    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._sequence = itertools.count()
        self._removed = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the timer is set on."""

    def add(self, job: Job, batcher: DynamicBatcher, budget_s: float) -> Entry:
        """Expire `job` in `budget_s` seconds unless `remove` is given what this returns first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        entry = [deadline, next(self._sequence), job, batcher, budget_s]
        heapq.heappush(self._heap, entry)
        if self._timer is None or deadline < self._timer_at or loop is not self._loop:
            self._set_timer(loop, deadline)
        return entry

    def remove(self, entry: Entry) -> None:
        """The request was answered or withdrawn: its deadline no longer matters."""
        if entry[2] is None:
            return
        entry[2] = entry[3] = None  # the job and its batcher are freed at once
        self._removed += 1
        if self._removed > _COMPACT_AT and self._removed * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
            self._removed = 0

    def __len__(self) -> int:
        """Requests whose deadlines are kept."""
        return len(self._heap) - self._removed

    def _set_timer(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._due, loop)
        self._timer_at = when
        self._loop = loop

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        """The earliest deadline came: expire every request whose deadline has passed, drop the
        removed entries on top, and set the timer for the next deadline."""
        self._timer = None
        heap = self._heap
        now = loop.time() + _RESOLUTION_S
        while heap:
            entry = heap[0]
            job = entry[2]
            if job is None:
                heapq.heappop(heap)
                self._removed -= 1
                continue
            if entry[0] > now:
                self._set_timer(loop, entry[0])
                return
            heapq.heappop(heap)
            batcher = entry[3]
            entry[2] = entry[3] = None  # out of the heap: a later `remove` finds nothing to do
            if job.future.get_loop() is loop:  # else its loop has ended, and nobody waits for it
                expire(job, batcher, entry[4])


def expire(job: Job, batcher: DynamicBatcher, timeout_s: float) -> None:
    """The deadline's end: a job not answered yet is withdrawn and answered 504."""
    if not job.future.done():
        batcher.cancel(job)
        job.future.set_exception(
            DeadlineExceeded(f"no answer within the request's deadline of {timeout_s:g} s")
        )
