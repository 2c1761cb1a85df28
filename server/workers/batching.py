"""DynamicBatcher: a bounded queue per model version that worker threads drain in batches.

The event loop `put`s jobs; it never blocks (a full queue raises `QueueFull` at once). A worker
thread calls `next_batch`: it blocks for the first job, then takes whatever else is queued, up to
`max_batch_size`. With `max_batch_delay` > 0 it waits for more until the first job has waited
that long; with 0 it never waits, so batches form only from requests that arrived while workers
were busy. Jobs past their deadline are handed back separately, to be answered 504 without
running; cancelled jobs (client gone, timed out) have already left the count and are dropped.
`wait_empty` blocks until no job waits, without polling: what unloading a model waits on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.server.errors import ModelNotReady, QueueFull, ServingError
from scriptserve.server.workers.streaming import PartStream

log = logging.getLogger("scriptserve.batching")

Decode = Callable[[], InferenceRequest]
"""Decodes a request as its client sent it, from a worker's thread; raises the ServingError that
answers it when it cannot (decoding.Admitted)."""


@dataclass(eq=False)
class Job:
    """One request waiting for, or being run by, a worker."""

    request: InferenceRequest
    """The request; while `decode` is set, an empty stand-in for it."""
    future: asyncio.Future[Any]
    """What the request ends with: `finish` of its response, or the ServingError that ended
    it (set by `delivery.deliver`); cancelled when its client went away or its deadline passed."""
    deadline: float
    """time.monotonic() after which the request is not worth running."""
    decode: Decode | None = None
    """Set for a request queued as it was sent: the worker that takes it decodes it
    (`decode_jobs`) before its batch runs."""
    finish: Callable[[InferenceResponse], Any] | None = None
    """What the data plane makes of the handler's response, on the worker's thread (the answer
    with the outputs the request asked for); None keeps the response as it is."""
    enqueued: float = field(default_factory=time.monotonic)
    dequeued: float = 0.0
    cancelled: bool = False
    taken: bool = False
    stream: PartStream[Any] | None = None
    """Where its parts go when its client takes the answer as a stream."""
    span_context: Any = None
    """(trace id, span id, flags) of its request's span, when it is traced (tracing.py)."""
    batch: BatchRecord | None = None
    """The run of the batch it was in, once a worker ran it (left on traced jobs only)."""


@dataclass(eq=False)
class BatchRecord:
    """One run of a batch by a worker, as the traces of its requests show it. It holds no job,
    so a traced job and its record make no reference cycle (they are freed with the request,
    not by the garbage collector)."""

    request_ids: list[str]
    """Of every request in the batch, in order."""
    traced: list[tuple[Any, str]]
    """The span context and request id of each traced request in it: what their spans link."""
    worker: int
    started: float
    """time.monotonic() when the worker began the batch."""
    ended: float = 0.0
    input_s: float = 0.0
    """Seconds of the handler's preprocessing (StageTimes), then of its postprocessing."""
    output_s: float = 0.0


@dataclass
class Batch:
    jobs: list[Job]
    expired: list[Job]


def decode_jobs(
    jobs: list[Job], model: str, version: str
) -> tuple[list[Job], list[tuple[Job, ServingError]]]:
    """From a worker's thread: decode the jobs' requests that were queued as sent. The jobs to
    run, and those whose request could not be decoded, each with the error that answers it."""
    _read_together(jobs, model, version)
    runnable: list[Job] = []
    failed: list[tuple[Job, ServingError]] = []
    for job in jobs:
        if job.decode is not None:
            try:
                job.request = job.decode()
            except ServingError as exc:
                failed.append((job, exc))
                continue
            finally:
                job.decode = None
        runnable.append(job)
    return runnable, failed


def _read_together(jobs: list[Job], model: str, version: str) -> None:
    """Let the wire objects that can read several requests in one go (a `read_together` on
    their class: OIP's JSON bodies) read those of the batch first; each job is still decoded,
    and fails, on its own. Reading together only saves work, so a failure in it is logged and
    the jobs are decoded one by one as they would have been."""
    readers: dict[Callable[[list[Any]], None], list[Any]] = {}
    for job in jobs:
        source = getattr(job.decode, "source", None)
        together = getattr(type(source), "read_together", None)
        if together is not None:
            readers.setdefault(together, []).append(source)
    for together, sources in readers.items():
        if len(sources) > 1:
            try:
                together(sources)
            except Exception:
                log.exception(
                    "model=%s version=%s reading %d requests together failed; each is read alone",
                    model,
                    version,
                    len(sources),
                )


class DynamicBatcher:
    def __init__(self, max_batch_size: int, max_batch_delay_s: float, max_queue_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self.max_queue_size = max_queue_size
        self._queue: deque[Job] = deque()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._emptied = threading.Condition(lock)
        """Notified when the last waiting job leaves the queue (taken, cancelled)."""
        self._pending = 0
        self._closed = False
        # Workers blocked in wait() and wake-ups sent to them but not yet taken: submit wakes a
        # worker only when one is idle and not already woken (a wake-up is a futex call, paid
        # on the event loop for every request otherwise).
        self._idle = 0
        self._woken = 0

    @property
    def depth(self) -> int:
        """Jobs waiting (not yet taken by a worker, not cancelled)."""
        return self._pending

    def put(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ModelNotReady("the model is shutting down; retry on another replica")
            if self._pending >= self.max_queue_size:
                raise QueueFull(
                    f"the model's queue is full ({self.max_queue_size} requests waiting); "
                    "retry later"
                )
            self._queue.append(job)
            self._pending += 1
            if self._idle > self._woken:
                self._woken += 1
                self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Forget a job the client no longer waits for; frees its slot if still queued."""
        with self._cond:
            if not job.taken and not job.cancelled:
                job.cancelled = True
                self._pending -= 1
                if not self._pending:
                    self._emptied.notify_all()

    def wake_all(self) -> None:
        """Wake blocked workers (to notice they were asked to stop)."""
        with self._cond:
            self._cond.notify_all()

    def wait_empty(self, timeout_s: float) -> bool:
        """Block until no job waits (each taken by a worker or cancelled), at most `timeout_s`;
        True when none does."""
        with self._cond:
            return self._emptied.wait_for(lambda: not self._pending, timeout_s)

    def close(self) -> None:
        """Refuse new jobs; queued ones are still handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take_all(self) -> list[Job]:
        """Remove and return every job still waiting (to fail them when stopping)."""
        with self._cond:
            jobs = [j for j in self._queue if not j.cancelled]
            for job in jobs:
                job.taken = True
            self._queue.clear()
            self._pending = 0
            self._emptied.notify_all()
            return jobs

    def _wait(self, timeout_s: float) -> None:
        """Wait on the condition as an idle worker (the lock is held)."""
        self._idle += 1
        try:
            self._cond.wait(timeout_s)
        finally:
            self._idle -= 1
            self._woken = min(self._woken, self._idle)

    def _pop_live(self, now: float, batch: Batch) -> None:
        while self._queue and len(batch.jobs) < self.max_batch_size:
            job = self._queue.popleft()
            if job.cancelled:
                continue
            job.taken = True
            job.dequeued = now
            self._pending -= 1
            (batch.expired if job.deadline <= now else batch.jobs).append(job)
        if not self._pending:
            self._emptied.notify_all()

    def next_batch(self, stop: threading.Event, poll_s: float = 0.5) -> Batch:
        """Block until there is work or `stop` is set; return the batch (possibly empty)."""
        batch = Batch([], [])
        with self._cond:
            while not batch.jobs:
                if stop.is_set():
                    return batch
                self._pop_live(time.monotonic(), batch)
                if batch.jobs or batch.expired:
                    break
                self._wait(poll_s)
            if self.max_batch_delay_s > 0 and batch.jobs:
                until = batch.jobs[0].enqueued + self.max_batch_delay_s
                while len(batch.jobs) < self.max_batch_size and not stop.is_set():
                    remaining = until - time.monotonic()
                    if remaining <= 0:
                        break
                    if not self._queue:
                        self._wait(remaining)
                    self._pop_live(time.monotonic(), batch)
                # The delay is queueing time too: the jobs are taken when the batch is handed over.
                handed = time.monotonic()
                for job in batch.jobs:
                    job.dequeued = handed
            # Another worker may be idle while jobs remain (we took at most a full batch).
            if self._queue and self._idle > self._woken:
                self._woken += 1
                self._cond.notify()
        return batch
