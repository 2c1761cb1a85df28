"""WorkerPool: threads that take batches from a model version's batcher and run its handler.

Each worker is bound to a device (`cpu`, or `cuda:N` round-robin). Handlers whose class is
`thread_safe` are built once per device and shared by that device's workers (one copy of the
weights); others get one instance per worker. The pool scales at runtime: new workers start
after their handler is ready, retiring workers finish their current batch first, so scaling
never drops a request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from handlers.backends import BackendError
from handlers.base import BaseHandler, Context, HandlerError, InferenceResponse
from server.batching import Batch, DynamicBatcher, Job
from server.errors import DeadlineExceeded, ModelNotReady, ServingError
from server.metrics import VersionMetrics

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


def _deliver(outcomes: list[tuple[Job, InferenceResponse | ServingError]]) -> None:
    """Runs on the event loop: resolve the futures nobody has given up on."""
    for job, outcome in outcomes:
        if job.future.done():
            continue
        if isinstance(outcome, ServingError):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)


class WorkerPool:
    def __init__(
        self,
        model: str,
        version: str,
        batcher: DynamicBatcher,
        factory: HandlerFactory,
        devices: list[str],
        metrics: VersionMetrics,
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

    # -- size -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
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
                device = self._devices[len(self._workers) % len(self._devices)]
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
            retiring = self._workers[n:]
            self._workers = self._workers[:n]
        for worker in retiring:
            worker.stop.set()
        self.batcher.wake_all()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every worker after its current batch; wait up to `timeout_s` for them."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop.set()
        self.batcher.wake_all()
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            if worker.thread is not None:
                worker.thread.join(max(0.0, deadline - time.monotonic()))
        leftovers = self.batcher.take_all()
        if leftovers:
            error = ModelNotReady("the model was stopped before this request ran; retry")
            outcomes: list[tuple[Job, InferenceResponse | ServingError]] = [
                (job, error) for job in leftovers
            ]
            leftovers[0].future.get_loop().call_soon_threadsafe(_deliver, outcomes)

    def describe(self) -> list[dict[str, object]]:
        return [
            {
                "id": f"{self.model}-{w.id}",
                "startTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(w.started_at)),
                "status": w.state.value,
                "device": w.device,
                "batches": w.batches,
                "gpu": w.device.startswith("cuda"),
            }
            for w in list(self._workers)
        ]

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in WorkerState if s is not WorkerState.STOPPED}
        for w in list(self._workers):
            counts[w.state.value] += 1
        return counts

    # -- the worker thread ------------------------------------------------------------------
    def _run(self, worker: Worker) -> None:
        while not worker.stop.is_set():
            batch = self.batcher.next_batch(worker.stop)
            if batch.expired:
                self._expire(batch)
            if batch.jobs:
                worker.state = WorkerState.BUSY
                self._process(worker, batch.jobs)
                worker.batches += 1
                worker.state = WorkerState.READY
        worker.state = WorkerState.STOPPED

    def _expire(self, batch: Batch) -> None:
        error = DeadlineExceeded("the request waited past its deadline and was not run")
        outcomes: list[tuple[Job, InferenceResponse | ServingError]] = [
            (job, error) for job in batch.expired
        ]
        batch.expired[0].future.get_loop().call_soon_threadsafe(_deliver, outcomes)

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
        jobs[0].future.get_loop().call_soon_threadsafe(_deliver, outcomes)
