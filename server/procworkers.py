"""ProcessWorkerPool: `worker_mode: process`, each worker a child process fed through shared memory.

Each worker is a child process (multiprocessing, spawn) that loads the archive's handler itself
and runs `handler.handle`, so a Python-heavy handler uses one core per worker, and a segfault,
an OOM kill or a hang takes down one worker instead of the server. In the server, one proxy
thread per worker takes batches from the model's DynamicBatcher exactly as a thread worker does,
copies the requests into the worker's shared-memory segment, sends a small description over the
worker's pipe, and waits for the answer at most the response timeout.

- A worker that dies (signal, exit 137 = out of memory, crash) fails the requests it was running
  at once with 503 / UNAVAILABLE saying how it died, and is replaced after a back-off that
  doubles with each crash in a row. More than `max_restarts` crashes within `restart_window_s`
  mark the model FAILED (no restart loop); its queued requests are answered 503 at once.
- A worker that does not answer within the response timeout is killed (SIGKILL) and replaced;
  its clients get 504 / DEADLINE_EXCEEDED. Requests still queued go to the other workers, or
  fail fast (503) when no live worker is left.
- `live` counts the workers able to take a batch; the model is ready while none is missing.
- `stop` lets each worker finish its batch, asks it to exit, and kills it after `stop_grace_s`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing import shared_memory
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from scriptserve.handlers.base import HandlerError, InferenceResponse
from scriptserve.server import shmframes
from scriptserve.server.batching import DynamicBatcher, Job
from scriptserve.server.errors import DeadlineExceeded, InferenceFailed, ModelNotReady, ServingError
from scriptserve.server.metrics import VersionMetrics
from scriptserve.server.procchild import ChildSpec, child_main
from scriptserve.server.workers import deliver, describe_worker, fail_jobs

log = logging.getLogger("scriptserve.procworkers")

START_TIMEOUT_S = 180.0
"""How long a new worker process may take to import its runtime and load the model."""
_MONITOR_INTERVAL_S = 0.2


class ProcState(str, Enum):
    STARTING = "STARTING"
    READY = "READY"
    BUSY = "BUSY"
    RESTARTING = "RESTARTING"
    STOPPED = "STOPPED"


_LIVE = (ProcState.READY, ProcState.BUSY)


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    stop_grace_s: float = 5.0


@dataclass(eq=False)
class ProcessWorker:
    id: int
    device: str
    stop: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)
    """Set on stop or when the process dies while idle: ends the proxy's wait for a batch."""
    state: ProcState = ProcState.STARTING
    started_at: float = field(default_factory=time.time)
    batches: int = 0
    crashes_in_row: int = 0
    thread: threading.Thread | None = None
    process: BaseProcess | None = None
    conn: Connection | None = None
    requests_shm: shared_memory.SharedMemory | None = None
    responses_shm: shared_memory.SharedMemory | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class _WorkerGone(Exception):
    """The worker process ended; the message says how."""


class _WorkerHung(Exception):
    """The worker process did not answer within the response timeout."""


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


class ProcessWorkerPool:
    def __init__(
        self,
        model: str,
        version: str,
        batcher: DynamicBatcher,
        spec: ChildSpec,
        devices: list[str],
        metrics: VersionMetrics,
        response_timeout_s: float,
        policy: RestartPolicy | None = None,
        on_failed: Callable[[str], None] | None = None,
    ) -> None:
        self.model = model
        self.version = version
        self.batcher = batcher
        self._spec = spec
        self._devices = devices or ["cpu"]
        self._metrics = metrics
        self._timeout_s = response_timeout_s
        self._policy = policy or RestartPolicy()
        self._on_failed = on_failed
        self._mp = multiprocessing.get_context("spawn")
        self._workers: list[ProcessWorker] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._crash_lock = threading.Lock()
        self._crashes: deque[float] = deque()
        self._closed = threading.Event()
        self.failed_reason: str | None = None
        self._monitor = threading.Thread(
            target=self._watch, name=f"procmonitor-{model}-{version}", daemon=True
        )
        self._monitor.start()

    # -- size -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self._workers)

    @property
    def live(self) -> int:
        return sum(1 for w in list(self._workers) if w.state in _LIVE)

    def pids(self) -> list[int]:
        return [pid for w in list(self._workers) if (pid := w.pid) is not None]

    def scale(self, n: int) -> None:
        """Grow or shrink to `n` workers. Blocking: new workers load their handler first.
        Raises HandlerError when a new worker cannot load the model."""
        with self._lock:
            fresh = []
            for i in range(len(self._workers), n):
                worker = ProcessWorker(next(self._ids), self._devices[i % len(self._devices)])
                self._spawn(worker)
                fresh.append(worker)
            failures = [(w, self._await_ready(w)) for w in fresh]
            problems = [(w, problem) for w, problem in failures if problem is not None]
            if problems:
                for w, _ in failures:
                    self._shutdown(w, grace_s=0.0)
                    self._release(w)
                raise HandlerError(f"a worker process could not load the model: {problems[0][1]}")
            for worker in fresh:
                worker.thread = threading.Thread(
                    target=self._run,
                    args=(worker,),
                    name=f"procworker-{self.model}-{self.version}-{worker.id}",
                    daemon=True,
                )
                self._workers.append(worker)
                worker.thread.start()
            retiring = self._workers[n:]
            self._workers = self._workers[:n]
        for worker in retiring:
            worker.stop.set()
            worker.wake.set()
        self.batcher.wake_all()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every worker after its current batch (waiting up to `timeout_s`), then end the
        processes: asked to exit, killed after the grace period."""
        self._closed.set()
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop.set()
            worker.wake.set()
        self.batcher.wake_all()
        deadline = time.monotonic() + timeout_s + self._policy.stop_grace_s
        for worker in workers:
            if worker.thread is not None:
                worker.thread.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            self._shutdown(worker, grace_s=0.0)  # a proxy still waiting on a hung worker
        fail_jobs(
            self.batcher.take_all(),
            ModelNotReady("the model was stopped before this request ran; retry"),
        )
        for worker in workers:
            if worker.thread is not None:
                worker.thread.join(max(0.0, deadline - time.monotonic()))
            self._release(worker)
        self._monitor.join(1.0)

    def describe(self) -> list[dict[str, object]]:
        return [
            describe_worker(self.model, w, pid=w.pid, mode="process") for w in list(self._workers)
        ]

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in ProcState if s is not ProcState.STOPPED}
        for w in list(self._workers):
            if w.state is not ProcState.STOPPED:
                counts[w.state.value] += 1
        return counts

    # -- process lifecycle ------------------------------------------------------------------
    def _spawn(self, worker: ProcessWorker) -> None:
        worker.state = ProcState.STARTING
        # The segments belong to the worker slot and outlive restarts; made before the first
        # child so that the children share this process's resource tracker.
        worker.requests_shm = shmframes.ensure_segment(worker.requests_shm, 0)
        worker.responses_shm = shmframes.ensure_segment(worker.responses_shm, 0)
        ours, theirs = self._mp.Pipe(duplex=True)
        spec = self._spec.on_device(worker.device)
        process = self._mp.Process(
            target=child_main,
            args=(theirs, spec),
            name=f"scriptserve-worker-{self.model}-{worker.id}",
            daemon=True,
        )
        process.start()
        theirs.close()
        worker.process, worker.conn = process, ours
        worker.started_at = time.time()

    def _await_ready(self, worker: ProcessWorker) -> str | None:
        """None once the worker has loaded its handler, else what went wrong."""
        try:
            reply = self._receive(worker, time.monotonic() + START_TIMEOUT_S)
        except _WorkerGone as exc:
            return f"the worker process {exc} while loading the model"
        except _WorkerHung:
            return f"the worker process did not load the model within {START_TIMEOUT_S:g} s"
        if reply[0] == "error":
            return str(reply[1])
        worker.state = ProcState.READY
        log.info(
            "model=%s version=%s worker %d ready (pid %s)",
            self.model, self.version, worker.id, worker.pid,
        )  # fmt: skip
        return None

    def _receive(self, worker: ProcessWorker, deadline: float) -> tuple[Any, ...]:
        process, conn = worker.process, worker.conn
        assert process is not None and conn is not None
        sentinel = process.sentinel
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _WorkerHung()
            ready = wait([conn, sentinel], remaining)
            if conn in ready:
                try:
                    message: tuple[Any, ...] = conn.recv()
                    return message
                except (EOFError, OSError):
                    ready.append(sentinel)
            if sentinel in ready:
                process.join(5.0)
                raise _WorkerGone(exit_description(process.exitcode))

    def _shutdown(self, worker: ProcessWorker, grace_s: float) -> None:
        """End the worker's process: ask it to exit, kill it (SIGKILL) after `grace_s`."""
        with worker.lock:
            process, conn = worker.process, worker.conn
            worker.process = worker.conn = None
        if process is None:
            return
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        if conn is not None:
            conn.close()

    def _release(self, worker: ProcessWorker) -> None:
        for segment in (worker.requests_shm, worker.responses_shm):
            if segment is not None:
                shmframes.release_segment(segment)
        worker.requests_shm = worker.responses_shm = None

    def _watch(self) -> None:
        """Notice processes that die while idle, so readiness drops and the proxy replaces them."""
        while not self._closed.is_set():
            watched: dict[int, tuple[ProcessWorker, BaseProcess]] = {}
            for worker in list(self._workers):
                process = worker.process
                if process is not None and worker.state is ProcState.READY:
                    watched[process.sentinel] = (worker, process)
            if not watched:
                self._closed.wait(_MONITOR_INTERVAL_S)
                continue
            try:
                dead = wait(list(watched), _MONITOR_INTERVAL_S)
            except (OSError, ValueError):  # a sentinel closed while waiting: look again
                continue
            for sentinel in dead:
                worker, process = watched[sentinel]  # type: ignore[index]
                # Only if that process is still the worker's: this thread may run late, after
                # the proxy has already replaced it.
                if worker.process is process and worker.state is ProcState.READY:
                    worker.state = ProcState.RESTARTING
                    worker.wake.set()
                    self.batcher.wake_all()

    # -- the proxy thread -------------------------------------------------------------------
    def _run(self, worker: ProcessWorker) -> None:
        try:
            while not worker.stop.is_set():
                if worker.process is None or not worker.process.is_alive():
                    if worker.process is not None:
                        self._lost(worker, [], "while idle")
                    if not self._restart(worker):
                        break
                    continue
                batch = self.batcher.next_batch(worker.wake)
                if worker.wake.is_set() and not worker.stop.is_set():
                    worker.wake.clear()
                    if worker.process.is_alive() and worker.state is ProcState.RESTARTING:
                        worker.state = ProcState.READY  # woken for a death that was not its own
                if batch.expired:
                    fail_jobs(
                        batch.expired,
                        DeadlineExceeded("the request waited past its deadline and was not run"),
                    )
                if batch.jobs:
                    self._process(worker, batch.jobs)
        except Exception:
            log.exception(
                "model=%s version=%s worker %d proxy failed", self.model, self.version, worker.id
            )
        finally:
            self._shutdown(worker, self._policy.stop_grace_s)
            worker.state = ProcState.STOPPED

    def _process(self, worker: ProcessWorker, jobs: list[Job]) -> None:
        for job in jobs:
            self._metrics.queue_latency.observe(job.dequeued - job.enqueued)
        self._metrics.batch_size.observe(len(jobs))
        started = time.perf_counter()
        worker.state = ProcState.BUSY
        try:
            responses = self._exchange(worker, jobs)
        except _WorkerGone as exc:
            self._lost(worker, jobs, f"({exc}) while running this request")
            return
        except _WorkerHung:
            self._hung(worker, jobs)
            return
        except (TypeError, ValueError, AttributeError, OSError, pickle.PicklingError) as exc:
            # A request whose parameters cannot be described; the worker itself is fine.
            log.exception(
                "model=%s version=%s could not hand a batch over", self.model, self.version
            )
            error = InferenceFailed(f"the request could not be sent to the worker process: {exc}")
            fail_jobs(jobs, error)
            worker.state = ProcState.READY
            return
        self._metrics.inference_latency.observe(time.perf_counter() - started)
        worker.batches += 1
        worker.crashes_in_row = 0
        worker.state = ProcState.READY
        outcomes: list[tuple[Job, InferenceResponse | ServingError]] = list(
            zip(jobs, responses, strict=True)
        )
        jobs[0].future.get_loop().call_soon_threadsafe(deliver, outcomes)

    def _exchange(self, worker: ProcessWorker, jobs: list[Job]) -> list[InferenceResponse]:
        """Send a batch to the worker process and read its responses back."""
        assert worker.conn is not None and worker.responses_shm is not None
        frame = shmframes.Frame()
        described = [shmframes.describe_request(frame, job.request) for job in jobs]
        worker.requests_shm = shmframes.ensure_segment(worker.requests_shm, frame.size)
        frame.write(shmframes.segment_view(worker.requests_shm))
        deadline = time.monotonic() + self._timeout_s
        try:
            worker.conn.send(
                ("run", worker.requests_shm.name, worker.responses_shm.name,
                 worker.responses_shm.size, described)
            )  # fmt: skip
        except (BrokenPipeError, ConnectionResetError) as exc:
            assert worker.process is not None
            worker.process.join(5.0)
            raise _WorkerGone(exit_description(worker.process.exitcode)) from exc
        while True:
            reply = self._receive(worker, deadline)
            if reply[0] == "grow":  # the responses need a bigger segment
                worker.responses_shm = shmframes.ensure_segment(worker.responses_shm, reply[1])
                worker.conn.send(("output", worker.responses_shm.name, worker.responses_shm.size))
                continue
            _, metas = reply
            buf = shmframes.segment_view(worker.responses_shm)
            return [shmframes.read_response(buf, meta) for meta in metas]

    # -- failures ---------------------------------------------------------------------------
    def _lost(self, worker: ProcessWorker, jobs: list[Job], when: str) -> None:
        """The worker process died: fail its requests, count the crash, let `_run` replace it."""
        worker.state = ProcState.RESTARTING
        exitcode = worker.process.exitcode if worker.process is not None else None
        self._shutdown(worker, grace_s=0.0)
        if self._closed.is_set():  # ended by `stop` after the drain timeout
            fail_jobs(jobs, ModelNotReady("the model was stopped before this request finished"))
            return
        how = exit_description(exitcode)
        ids = ",".join(j.request.request_id for j in jobs) or "-"
        log.error(
            "model=%s version=%s request_ids=%s worker %d died (%s)",
            self.model, self.version, ids, worker.id, how,
        )  # fmt: skip
        if jobs:
            message = f"worker for model {self.model!r} died {when}; retry"
            fail_jobs(jobs, ModelNotReady(message))
        self._crashed(worker, f"a worker died ({how})")

    def _hung(self, worker: ProcessWorker, jobs: list[Job]) -> None:
        worker.state = ProcState.RESTARTING
        ids = ",".join(j.request.request_id for j in jobs)
        log.error(
            "model=%s version=%s request_ids=%s worker %d (pid %s) did not answer within the "
            "response timeout of %g s; killing it",
            self.model, self.version, ids, worker.id, worker.pid, self._timeout_s,
        )  # fmt: skip
        self._shutdown(worker, grace_s=0.0)
        fail_jobs(
            jobs,
            DeadlineExceeded(
                f"the worker for model {self.model!r} did not answer within the response timeout "
                f"of {self._timeout_s:g} s; it was stopped and is being replaced"
            ),
        )
        self._crashed(worker, f"a worker hung past the response timeout of {self._timeout_s:g} s")

    def _crashed(self, worker: ProcessWorker, reason: str) -> None:
        worker.crashes_in_row += 1
        now = time.monotonic()
        newly_failed = False
        with self._crash_lock:
            self._crashes.append(now)
            while self._crashes and self._crashes[0] < now - self._policy.restart_window_s:
                self._crashes.popleft()
            crashes = len(self._crashes)
            if crashes > self._policy.max_restarts and self.failed_reason is None:
                newly_failed = True
                self.failed_reason = (
                    f"{crashes} worker failures within {self._policy.restart_window_s:g} s, "
                    f"the last: {reason}; unregister and register the model again"
                )
        if newly_failed:
            self._fail_model()
        elif self.live == 0:
            # Nobody is left to run what is queued: answer now rather than at each deadline.
            fail_jobs(
                self.batcher.take_all(),
                ModelNotReady(
                    f"model {self.model!r} has no live worker ({reason}); "
                    "a replacement is starting; retry"
                ),
            )

    def _fail_model(self) -> None:
        reason = self.failed_reason or "failed"
        for worker in list(self._workers):
            worker.stop.set()
            worker.wake.set()
        self.batcher.wake_all()
        if self._on_failed is not None and not self._closed.is_set():
            self._on_failed(reason)
        fail_jobs(self.batcher.take_all(), ModelNotReady(f"model {self.model!r} failed: {reason}"))

    def _restart(self, worker: ProcessWorker) -> bool:
        """Replace the worker's process after its back-off; False when it should not come back."""
        if self.failed_reason is not None or worker.stop.is_set():
            return False
        worker.state = ProcState.RESTARTING
        policy = self._policy
        delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** max(0, worker.crashes_in_row - 1))
        log.warning(
            "model=%s version=%s replacing worker %d in %.2g s (crash %d in a row)",
            self.model, self.version, worker.id, delay, worker.crashes_in_row,
        )  # fmt: skip
        if worker.stop.wait(delay):
            return False
        self._spawn(worker)
        problem = self._await_ready(worker)
        if problem is not None:
            log.error(
                "model=%s version=%s replacement worker failed: %s",
                self.model, self.version, problem,
            )  # fmt: skip
            self._shutdown(worker, grace_s=0.0)
            worker.state = ProcState.RESTARTING
            self._crashed(worker, problem)
            return self.failed_reason is None
        self._metrics.worker_restarts.inc()
        return True
