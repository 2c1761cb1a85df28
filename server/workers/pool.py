"""WorkerPool: the workers of one model version, taking batches from its DynamicBatcher.

A pool has `size` slots. Each slot has a thread that takes a batch from the batcher, has the
pool's runner run it, and hands the answers back to the event loop. The runner decides what a
worker is: a thread of this process calling the handler (`ThreadRunner`), or a child process fed
through shared memory (`ProcessRunner`). The pool owns what both share: scaling, the
take / run / deliver loop, expiry of requests past their deadline, metrics, describe, counts,
stop, and the model's failure.

`live` counts the slots whose worker can take a batch now; the model is ready while no slot is
missing its worker (`live == size`), and serves while one is there (`live > 0`). Scaling never
drops a request: new workers start before they join, retiring ones finish their batch first.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar

from scriptserve.handlers.base import InferenceRequest, InferenceResponse, StageTimes
from scriptserve.handlers.parts import PartSink
from scriptserve.server.errors import (
    DeadlineExceeded,
    ModelNotReady,
    ServingError,
)
from scriptserve.server.observability.metrics import VersionMetrics
from scriptserve.server.workers.batching import DynamicBatcher, Job, decode_jobs
from scriptserve.server.workers.capture import Capture
from scriptserve.server.workers.delivery import fail_jobs, hand_back, traced
from scriptserve.server.workers.streaming import JobParts
from scriptserve.server.workers.warmup import WarmupResult

log = logging.getLogger("scriptserve.workers")


class WorkerState(str, Enum):
    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    RESTARTING = "RESTARTING"
    STOPPED = "STOPPED"


LIVE_STATES = (WorkerState.READY, WorkerState.BUSY)
# A worker in one of these is coming (back): a lost one replaced, or waiting out its back-off.
COMING_STATES = (WorkerState.STARTING, WorkerState.RESTARTING)


@dataclass(frozen=True)
class RestartPolicy:
    """How a pool replaces workers it lost (a dead process, a thread stuck in the handler)."""

    backoff_s: float = 1.0
    """Delay before the first retry; it doubles with each failure in a row."""
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    """Process workers lost within `restart_window_s` before the model is marked FAILED."""
    restart_window_s: float = 300.0
    stop_grace_s: float = 5.0
    """How long a stopping worker process may take to exit before it is killed."""

    def backoff(self, failures_in_row: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** max(0, failures_in_row - 1))


@dataclass(eq=False)
class Slot:
    """One place in a pool and the worker serving it; runners add what their worker needs."""

    id: int
    device: str
    state: WorkerState = WorkerState.STARTING
    started_at: float = field(default_factory=time.time)
    batches: int = 0
    busy_since: float = 0.0
    """time.monotonic() when the current batch started (valid while BUSY)."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set when the slot retires (scale down, stop, model failed)."""
    wake: threading.Event = field(default_factory=threading.Event)
    """Ends the slot's wait for a batch: set with `stop`, or when its worker needs a look."""
    thread: threading.Thread | None = None
    abandoned: bool = False
    """Its thread was given up (stuck in the handler): not waited for when the pool stops."""
    warmup: WarmupResult | None = None
    """What its worker's warm-up did before the slot joined; None when warm-up is off."""
    profiling: bool = False
    """Its worker runs a profiler of its own for a capture (process workers)."""


S = TypeVar("S", bound=Slot)


class WorkerLost(Exception):
    """The worker running a batch is gone (it died, hung, or could not be handed the batch).
    The runner has dealt with the worker; `error` answers the batch's requests."""

    def __init__(self, error: ServingError) -> None:
        super().__init__(error.message)
        self.error = error


class Runner(Protocol[S]):
    """What a worker is. Methods taking `pool` are called from the pool's threads."""

    @property
    def mode(self) -> str:
        """`thread` or `process`."""

    @property
    def reported_states(self) -> tuple[WorkerState, ...]:
        """States that `counts` reports even at zero."""

    @property
    def stop_grace_s(self) -> float:
        """How much longer than the drain a stopping worker may take."""

    def open(self, pool: WorkerPool[S], places: list[tuple[int, str]]) -> list[S]:
        """Blocking: a slot with a worker ready to run batches for each (id, device); raises
        HandlerError when one cannot start, leaving none running."""

    def serve(self, pool: WorkerPool[S], slot: S) -> None:
        """Body of the slot's thread: set up what the worker holds for its life, `pool.serve`."""

    def prepare(self, pool: WorkerPool[S], slot: S) -> bool:
        """Before each wait for a batch: replace a lost worker; False ends the slot's loop."""

    def run(
        self,
        pool: WorkerPool[S],
        slot: S,
        requests: list[InferenceRequest],
        times: StageTimes,
        parts: PartSink,
    ) -> list[InferenceResponse]:
        """One response per request, the batch's stages timed into `times`, streamed parts
        sent to `parts`; raises WorkerLost."""

    def watch(self, pool: WorkerPool[S]) -> None:
        """Body of the pool's watcher thread; returns once `pool.closed` is set."""

    def release(self, pool: WorkerPool[S], slots: list[S], deadline: float) -> None:
        """After `stop` waited for the slots' threads until `deadline`: end what is left."""

    def describe(self, slot: S) -> dict[str, object]:
        """Fields describe adds for this kind of worker."""

    def profile(self, pool: WorkerPool[S], slot: S, capture: Capture | None) -> None:
        """Before each wait for a batch while a capture is on or the slot's worker still
        profiles: start or end the worker's own profiler as `capture` says (None or done:
        end it and hand its trace to the capture)."""

    def handlers_alive(self) -> int:
        """Handlers this runner built in this process that are still alive."""

    def idle(self, pool: WorkerPool[S]) -> None:
        """The pool was scaled to no worker: let go of what was kept for new workers (a
        shared handler), so that the model's memory is freed once its workers have stopped."""


def describe_worker(model: str, slot: Slot, **extra: object) -> dict[str, object]:
    """One worker as the management API's describe lists it (TorchServe's keys)."""
    return {
        "id": f"{model}-{slot.id}",
        "startTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(slot.started_at)),
        "status": slot.state.value,
        "device": slot.device,
        "batches": slot.batches,
        "gpu": slot.device.startswith("cuda"),
        **(slot.warmup.describe() if slot.warmup is not None else {}),
        **extra,
    }


class WorkerPool(Generic[S]):
    """The workers of one model version; see the module docstring.

    pool = WorkerPool("tiny", "1.0", batcher, ThreadRunner(build), ["cpu"], metrics)
    pool.scale(2)  # blocking: both workers have loaded their handler
    ...
    pool.stop()
    """

    def __init__(
        self,
        model: str,
        version: str,
        batcher: DynamicBatcher,
        runner: Runner[S],
        devices: list[str],
        metrics: VersionMetrics,
    ) -> None:
        self.model = model
        self.version = version
        self.batcher = batcher
        self.runner = runner
        self.metrics = metrics
        self.closed = threading.Event()
        self.failed_reason: str | None = None
        """Why the model cannot serve any more (its workers keep failing); None while it can."""
        self.capture: Capture | None = None
        """The profiling capture of its batches, while one runs
        (server/models/profiling.py)."""
        self._devices = devices or ["cpu"]
        self._slots: list[S] = []
        self._retiring: list[S] = []
        """Slots scaled away whose thread may still be finishing its batch."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._watcher = threading.Thread(
            target=runner.watch, args=(self,), name=f"watch-{model}-{version}", daemon=True
        )
        self._watcher.start()

    @property
    def mode(self) -> str:
        return self.runner.mode

    # -- size -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self._slots)

    @property
    def live(self) -> int:
        """Slots whose worker can take a batch now."""
        return sum(1 for slot in list(self._slots) if slot.state in LIVE_STATES)

    @property
    def replacing(self) -> bool:
        """A worker lost is being replaced: a request can wait in the queue for it."""
        return any(slot.state in COMING_STATES for slot in list(self._slots))

    def slots(self) -> list[S]:
        return list(self._slots)

    @property
    def busy(self) -> bool:
        """A worker is running a batch now."""
        return any(slot.state is WorkerState.BUSY for slot in list(self._slots))

    def handlers_alive(self) -> int:
        """Handlers of this pool still alive in this process (after `stop`: only those a
        reference cycle or a stuck thread holds)."""
        return self.runner.handlers_alive()

    def scale(self, n: int) -> None:
        """Grow or shrink to `n` workers. Blocking: new workers load their handler first; when
        one cannot, HandlerError is raised and the pool is left as it was. A stopped pool
        raises ModelNotReady: its version is gone, and no worker may start for it."""
        with self._lock:
            if self.closed.is_set():
                raise ModelNotReady(
                    f"model {self.model!r} version {self.version} was stopped; it cannot be scaled"
                )
            first = len(self._slots)
            places = [
                (next(self._ids), self._devices[i % len(self._devices)]) for i in range(first, n)
            ]
            for slot in self.runner.open(self, places) if places else []:
                self._slots.append(slot)
                self._launch(slot)
            retiring = self._slots[n:]
            self._slots = self._slots[:n]
            self._retiring = [s for s in self._retiring if s.state is not WorkerState.STOPPED]
            self._retiring += retiring
            if not self._slots:
                self.runner.idle(self)
        for slot in retiring:
            slot.stop.set()
            slot.wake.set()
        self.batcher.wake_all()

    def wait_retired(self, timeout_s: float = 30.0) -> bool:
        """Blocking: wait for the threads of the slots scaled away to end (each finishes its
        batch first), at most `timeout_s`; True when all have."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            retiring, self._retiring = self._retiring, []
        for slot in retiring:
            if slot.thread is not None and not slot.abandoned:
                slot.thread.join(max(0.0, deadline - time.monotonic()))
        return all(s.thread is None or not s.thread.is_alive() for s in retiring)

    def next_id(self) -> int:
        return next(self._ids)

    def replace(self, old: S, new: S) -> bool:
        """Put `new` (ready to serve) in the place of `old` and start it; False when `old` is
        no longer in the pool (scaled away, stopped)."""
        with self._lock:
            if self.closed.is_set() or old not in self._slots:
                return False
            self._slots[self._slots.index(old)] = new
            self._launch(new)
            return True

    def _launch(self, slot: S) -> None:
        slot.thread = threading.Thread(
            target=self.runner.serve,
            args=(self, slot),
            name=f"{self.mode}-worker-{self.model}-{self.version}-{slot.id}",
            daemon=True,
        )
        slot.thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every worker after its current batch, waiting up to `timeout_s` (and the
        runner's grace period) for them; requests still queued are answered 503."""
        self.closed.set()
        with self._lock:
            slots, self._slots = self._slots, []
        for slot in slots:
            slot.stop.set()
            slot.wake.set()
        self.batcher.wake_all()
        deadline = time.monotonic() + timeout_s + self.runner.stop_grace_s
        for slot in slots:
            if slot.thread is not None and not slot.abandoned:
                slot.thread.join(max(0.0, deadline - time.monotonic()))
        self.runner.release(self, slots, deadline)
        fail_jobs(
            self.batcher.take_all(),
            ModelNotReady("the model was stopped before this request ran; retry"),
        )
        self._watcher.join(1.0)

    def fail(self, reason: str) -> None:
        """The model cannot serve any more: stop every worker, answer what is queued (503).
        The model version reads `failed_reason` as its FAILED state."""
        with self._lock:
            if self.failed_reason is not None:
                return
            self.failed_reason = reason
            slots = list(self._slots)
        log.error("model=%s version=%s marked FAILED: %s", self.model, self.version, reason)
        for slot in slots:
            slot.stop.set()
            slot.wake.set()
        self.batcher.wake_all()
        fail_jobs(self.batcher.take_all(), ModelNotReady(f"model {self.model!r} failed: {reason}"))

    def look(self) -> None:
        """Have every slot's thread go round its loop once (e.g. to end its worker's
        profiler), whether or not a batch is waiting."""
        for slot in self.slots():
            slot.wake.set()
        self.batcher.wake_all()

    def fail_queued(self, error: ServingError) -> None:
        fail_jobs(self.batcher.take_all(), error)

    # -- what clients and metrics see --------------------------------------------------------
    def describe(self) -> list[dict[str, object]]:
        return [describe_worker(self.model, s, **self.runner.describe(s)) for s in self.slots()]

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in self.runner.reported_states}
        for slot in self.slots():
            if slot.state is not WorkerState.STOPPED:
                counts[slot.state.value] = counts.get(slot.state.value, 0) + 1
        return counts

    # -- a slot's thread ---------------------------------------------------------------------
    def serve(self, slot: S) -> None:
        """The loop of one slot's thread: take a batch, run it, hand the answers back."""
        while not slot.stop.is_set():
            if not self.runner.prepare(self, slot):
                return
            capture = self.capture
            if capture is not None or slot.profiling:
                self.runner.profile(self, slot, capture)
            batch = self.batcher.next_batch(slot.wake)
            if slot.wake.is_set() and not slot.stop.is_set():
                slot.wake.clear()  # woken to look at its worker: `prepare` does, next round
            if batch.expired:
                fail_jobs(
                    batch.expired,
                    DeadlineExceeded("the request waited past its deadline and was not run"),
                )
            if batch.jobs:
                self._run(slot, batch.jobs)

    def _parts(self, jobs: list[Job]) -> JobParts:
        """Where the batch's streamed parts go: each job's stream; a job without one (its
        client takes one answer) is refused."""

        def finish(index: int, outcome: object) -> None:
            hand_back([jobs[index]], [outcome])

        return JobParts([j.future for j in jobs], [j.stream for j in jobs], finish, self.model)

    def _run(self, slot: S, jobs: list[Job]) -> None:
        slot.busy_since = taken = time.monotonic()
        slot.state = WorkerState.BUSY
        times = StageTimes()
        started = time.perf_counter()
        jobs, undecodable = decode_jobs(jobs, self.model, self.version)
        if undecodable:
            # Refused as they would have been before queueing: no queue or compute time.
            hand_back([job for job, _ in undecodable], [error for _, error in undecodable])
        times.input_s = time.perf_counter() - started  # decoding is the batch's input too
        if not jobs:
            if slot.state is WorkerState.BUSY:
                slot.state = WorkerState.READY
            return
        self.metrics.observe_taken([job.dequeued - job.enqueued for job in jobs])
        requests = [job.request for job in jobs]
        record = traced(jobs, slot.id, taken)
        capture = self.capture
        try:
            if capture is not None and not capture.done.is_set():
                with capture.range([r.request_id for r in requests]):
                    responses = self.runner.run(self, slot, requests, times, self._parts(jobs))
                capture.count()
            else:
                responses = self.runner.run(self, slot, requests, times, self._parts(jobs))
        except WorkerLost as lost:
            fail_jobs(jobs, lost.error)
            return
        finally:
            if record is not None:
                record.ended = time.monotonic()
                record.input_s, record.output_s = times.input_s, times.output_s
        self.metrics.observe_batch(requests, time.perf_counter() - started, times)
        slot.batches += 1
        if slot.state is WorkerState.BUSY:  # not if it was given up meanwhile
            slot.state = WorkerState.READY
        hand_back(jobs, responses)
