"""WorkerPool: threads that take batches from a model version's batcher and run its handler.

Each worker is bound to a device (`cpu`, or `cuda:N` round-robin). Handlers whose class is
`thread_safe` are built once per device and shared by that device's workers (one copy of the
weights); others get one instance per worker. The pool scales at runtime: new workers start
after their handler is ready, retiring workers finish their current batch first, so scaling
never drops a request.

A watchdog notices a worker stuck in one model call past the response timeout. A thread cannot
be killed: the stuck one is abandoned (its result is dropped when it returns; its clients have
had their 504 from the data plane's timer) and a replacement thread keeps the model serving.
With more than `max_abandoned` abandoned threads still stuck, the model is reported failed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import BaseHandler, Context, HandlerError, InferenceResponse
from scriptserve.handlers.loader import worker_scope
from scriptserve.server.batching import Batch, DynamicBatcher, Job
from scriptserve.server.errors import DeadlineExceeded, ModelNotReady, ServingError
from scriptserve.server.metrics import VersionMetrics

log = logging.getLogger("scriptserve.workers")

HandlerFactory = Callable[[str], tuple[BaseHandler, Context]]
"""Builds and initializes a handler for a device; blocking (loads the model)."""


class WorkerState(str, Enum):
    READY = "READY"
    BUSY = "BUSY"
    STOPPED = "STOPPED"


@dataclass(eq=False)
class Worker:
    id: int
    device: str
    handler: BaseHandler
    context: Context
    stop: threading.Event = field(default_factory=threading.Event)
    state: WorkerState = WorkerState.READY
    started_at: float = field(default_factory=time.time)
    batches: int = 0
    thread: threading.Thread | None = None
    busy_since: float = 0.0
    """time.monotonic() when the current batch started (valid while BUSY)."""
    abandoned: bool = False


def deliver(outcomes: list[tuple[Job, InferenceResponse | ServingError]]) -> None:
    """Runs on the event loop: resolve the futures nobody has given up on."""
    for job, outcome in outcomes:
        if job.future.done():
            continue
        if isinstance(outcome, ServingError):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)


def fail_jobs(jobs: list[Job], error: ServingError) -> None:
    """Answer `jobs` with `error` (from any thread); futures already done are left alone."""
    if jobs:
        outcomes: list[tuple[Job, InferenceResponse | ServingError]] = [(j, error) for j in jobs]
        jobs[0].future.get_loop().call_soon_threadsafe(deliver, outcomes)


class DescribedWorker(Protocol):
    id: int
    device: str
    started_at: float
    batches: int

    @property
    def state(self) -> Enum: ...


def describe_worker(model: str, worker: DescribedWorker, **extra: object) -> dict[str, object]:
    """One worker as the management API's describe lists it (TorchServe's keys)."""
    return {
        "id": f"{model}-{worker.id}",
        "startTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(worker.started_at)),
        "status": worker.state.value,
        "device": worker.device,
        "batches": worker.batches,
        "gpu": worker.device.startswith("cuda"),
        **extra,
    }


class WorkerPool:
    def __init__(
        self,
        model: str,
        version: str,
        batcher: DynamicBatcher,
        factory: HandlerFactory,
        devices: list[str],
        metrics: VersionMetrics,
        response_timeout_s: float | None = None,
        max_abandoned: int = 4,
        on_failed: Callable[[str], None] | None = None,
    ) -> None:
        self.model = model
        self.version = version
        self.batcher = batcher
        self._factory = factory
        self._devices = devices or ["cpu"]
        self._metrics = metrics
        self._workers: list[Worker] = []
        self._shared: dict[str, tuple[BaseHandler, Context]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._response_timeout_s = response_timeout_s
        self._max_abandoned = max_abandoned
        self._on_failed = on_failed
        self._abandoned: list[Worker] = []
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()

    # -- size -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self._workers)

    @property
    def live(self) -> int:
        """Workers able to take a batch (a stuck thread is replaced at once, so all of them)."""
        return len(self._workers)

    def _handler_for(self, device: str) -> tuple[BaseHandler, Context]:
        if device in self._shared:
            return self._shared[device]
        handler, context = self._factory(device)
        if getattr(handler, "thread_safe", False):
            self._shared[device] = (handler, context)
        return handler, context

    def scale(self, n: int) -> None:
        """Grow or shrink to `n` workers. Blocking: new workers load their handler first."""
        with self._lock:
            while len(self._workers) < n:
                self._start_worker(self._devices[len(self._workers) % len(self._devices)])
            retiring = self._workers[n:]
            self._workers = self._workers[:n]
            if self._response_timeout_s is not None and self._watchdog is None and n:
                self._watchdog = threading.Thread(
                    target=self._watch, name=f"watchdog-{self.model}-{self.version}", daemon=True
                )
                self._watchdog.start()
        for worker in retiring:
            worker.stop.set()
        self.batcher.wake_all()

    def _start_worker(self, device: str) -> None:
        """Build (or share) a handler for `device` and start a worker thread on it (lock held)."""
        handler, context = self._handler_for(device)
        worker = Worker(next(self._ids), device, handler, context)
        worker.thread = threading.Thread(
            target=self._run,
            args=(worker,),
            name=f"worker-{self.model}-{self.version}-{worker.id}",
            daemon=True,
        )
        self._workers.append(worker)
        worker.thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every worker after its current batch; wait up to `timeout_s` for them."""
        self._closed.set()
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop.set()
        self.batcher.wake_all()
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            if worker.thread is not None:
                worker.thread.join(max(0.0, deadline - time.monotonic()))
        error = ModelNotReady("the model was stopped before this request ran; retry")
        fail_jobs(self.batcher.take_all(), error)

    def describe(self) -> list[dict[str, object]]:
        return [describe_worker(self.model, w) for w in list(self._workers)]

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in WorkerState if s is not WorkerState.STOPPED}
        for w in list(self._workers):
            counts[w.state.value] += 1
        return counts

    # -- the worker thread ------------------------------------------------------------------
    def _run(self, worker: Worker) -> None:
        with worker_scope(worker.handler):
            self._serve(worker)
        worker.state = WorkerState.STOPPED

    def _serve(self, worker: Worker) -> None:
        while not worker.stop.is_set():
            batch = self.batcher.next_batch(worker.stop)
            if batch.expired:
                self._expire(batch)
            if batch.jobs:
                worker.busy_since = time.monotonic()
                worker.state = WorkerState.BUSY
                self._process(worker, batch.jobs)
                worker.batches += 1
                worker.state = WorkerState.READY
                if worker.abandoned:
                    log.warning(
                        "model=%s version=%s worker %d returned after %.1f s, past its response "
                        "timeout; its result was dropped",
                        self.model, self.version, worker.id, time.monotonic() - worker.busy_since,
                    )  # fmt: skip

    # -- the watchdog -----------------------------------------------------------------------
    def _watch(self) -> None:
        assert self._response_timeout_s is not None
        timeout = self._response_timeout_s
        interval = min(1.0, max(0.05, timeout / 4))
        while not self._closed.wait(interval):
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.state is WorkerState.BUSY and now - worker.busy_since > timeout:
                    self._abandon(worker, now - worker.busy_since)

    def _abandon(self, worker: Worker, stuck_s: float) -> None:
        """Replace a worker stuck in the handler; it stops once (if ever) its call returns."""
        with self._lock:
            if worker not in self._workers or self._closed.is_set():
                return
            self._workers.remove(worker)
            worker.abandoned = True
            worker.stop.set()
            self._abandoned = [w for w in self._abandoned if w.thread and w.thread.is_alive()]
            self._abandoned.append(worker)
            self._metrics.workers_stuck.inc()
            log.error(
                "model=%s version=%s worker %d stuck in the handler for %.1f s (response timeout "
                "%g s); abandoning the thread (%d abandoned and still stuck)",
                self.model, self.version, worker.id, stuck_s, self._response_timeout_s,
                len(self._abandoned),
            )  # fmt: skip
            if len(self._abandoned) > self._max_abandoned:
                reason = (
                    f"{len(self._abandoned)} worker threads are stuck in the handler past the "
                    f"response timeout of {self._response_timeout_s:g} s"
                )
                log.error("model=%s version=%s marked failed: %s", self.model, self.version, reason)
                if self._on_failed is not None:
                    self._on_failed(reason)
                fail_jobs(self.batcher.take_all(), ModelNotReady(f"model {self.model!r}: {reason}"))
                return
            try:
                self._start_worker(worker.device)
            except Exception:
                log.exception(
                    "model=%s version=%s could not start a replacement worker",
                    self.model, self.version,
                )  # fmt: skip
                return
            self._metrics.worker_restarts.inc()

    def _expire(self, batch: Batch) -> None:
        error = DeadlineExceeded("the request waited past its deadline and was not run")
        outcomes: list[tuple[Job, InferenceResponse | ServingError]] = [
            (job, error) for job in batch.expired
        ]
        batch.expired[0].future.get_loop().call_soon_threadsafe(deliver, outcomes)

    def _process(self, worker: Worker, jobs: list[Job]) -> None:
        for job in jobs:
            self._metrics.queue_latency.observe(job.dequeued - job.enqueued)
        self._metrics.batch_size.observe(len(jobs))
        started = time.perf_counter()
        try:
            results = worker.handler.handle([j.request for j in jobs], worker.context)
        except HandlerError as exc:
            results = [InferenceResponse.failed(exc.message, exc.status)] * len(jobs)
        except BackendError as exc:
            results = [InferenceResponse.failed(str(exc), 500)] * len(jobs)
        except Exception as exc:
            # A handler bug fails only this batch; the worker keeps serving.
            log.exception(
                "model=%s version=%s request_ids=%s handler raised",
                self.model, self.version, ",".join(j.request.request_id for j in jobs),
            )  # fmt: skip
            message = f"the handler failed: {type(exc).__name__}: {exc}"
            results = [InferenceResponse.failed(message, 500)] * len(jobs)
        self._metrics.inference_latency.observe(time.perf_counter() - started)
        outcomes: list[tuple[Job, InferenceResponse | ServingError]] = list(
            zip(jobs, results, strict=True)
        )
        jobs[0].future.get_loop().call_soon_threadsafe(deliver, outcomes)
