"""ProcessRunner: `worker_mode: process`, each worker a child process fed through shared memory.

Each worker is a child process (forked by multiprocessing's fork server, which has imported
torch once) that loads the archive's handler itself and runs its batches, so a Python-heavy
handler uses one core per worker, and a segfault, an OOM kill or a hang takes down one worker
instead of the server. The slot's thread in the server takes batches from the model's
DynamicBatcher as a thread worker does, copies the requests into the worker's shared-memory
segment, sends a small description over the worker's pipe, and waits for the answer at most the
response timeout.

- A worker that dies (signal, exit 137 = out of memory, crash) fails the requests it was running
  at once with 503 / UNAVAILABLE saying how it died, and is replaced after a back-off that
  doubles with each crash in a row. More than `max_restarts` crashes within `restart_window_s`
  mark the model FAILED (no restart loop); its queued requests are answered 503 at once. A
  replacement that cannot be started at all (the server out of file descriptors or processes)
  counts as a failed one, and is tried again after the back-off.
- A worker that does not answer within the response timeout is killed (SIGKILL) and replaced;
  its clients get 504 / DEADLINE_EXCEEDED. Requests still queued go to the other workers, or
  fail fast (503) when no live worker is left.
- A worker that dies while idle is noticed by the watcher, so readiness drops at once.
- Stopping lets each worker finish its batch, asks it to exit, and kills it after the grace.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from dataclasses import replace
from multiprocessing.connection import wait
from threading import Lock
from time import monotonic

from scriptserve.handlers.base import (
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
    StageTimes,
)
from scriptserve.handlers.parts import PartSink
from scriptserve.server.errors import DeadlineExceeded, InferenceFailed, ModelNotReady, ServingError
from scriptserve.server.observability.log_format import current_format
from scriptserve.server.workers.capture import Capture
from scriptserve.server.workers.pool import (
    RestartPolicy,
    WorkerLost,
    WorkerPool,
    WorkerState,
)
from scriptserve.server.workers.process import shared_memory as frames
from scriptserve.server.workers.process.capture import follow_capture
from scriptserve.server.workers.process.child import ChildSpec
from scriptserve.server.workers.process.child_process import (
    Child,
    WorkerGone,
    WorkerHung,
    exit_description,
    spawn,
)
from scriptserve.server.workers.process.exchange import exchange
from scriptserve.server.workers.process.slot import ProcessSlot

log = logging.getLogger("scriptserve.workers.process")

START_TIMEOUT_S = 180.0
"""How long a new worker process may take to import its runtime, load the model and warm it up."""
_WATCH_INTERVAL_S = 0.2


class ProcessRunner:
    mode = "process"
    reported_states = (
        WorkerState.STARTING,
        WorkerState.READY,
        WorkerState.BUSY,
        WorkerState.RESTARTING,
    )

    def __init__(
        self,
        context: Context,
        response_timeout_s: float,
        policy: RestartPolicy | None = None,
        warmup_runs: int = 0,
    ) -> None:
        self._context = context
        self._warmup_runs = warmup_runs
        self._timeout_s = response_timeout_s
        self._policy = policy or RestartPolicy()
        self._crash_lock = Lock()
        self._crashes: deque[float] = deque()

    @property
    def stop_grace_s(self) -> float:
        return self._policy.stop_grace_s

    def handlers_alive(self) -> int:
        return 0  # the handlers live in the worker processes

    def idle(self, pool: WorkerPool[ProcessSlot]) -> None:
        pass  # each worker process holds its own model, gone with it

    # -- the runner protocol -----------------------------------------------------------------
    def open(
        self, pool: WorkerPool[ProcessSlot], places: list[tuple[int, str]]
    ) -> list[ProcessSlot]:
        slots: list[ProcessSlot] = []
        try:
            for slot_id, device in places:
                requests = frames.ensure_segment(None, 0)
                try:
                    responses = frames.ensure_segment(None, 0)
                except OSError:
                    frames.release_segment(requests)
                    raise
                slots.append(
                    ProcessSlot(id=slot_id, device=device, requests=requests, responses=responses)
                )
        except OSError as exc:  # out of descriptors or shared memory
            for slot in slots:
                self._release(slot)
            raise HandlerError(f"a worker process could not be started ({_reason(exc)})") from None
        # Every process starts loading before any is waited for: they load side by side.
        not_started = [self._start(pool, slot) for slot in slots]
        outcomes = [
            problem or self._await_ready(pool, slot)
            for slot, problem in zip(slots, not_started, strict=True)
        ]
        problems = [problem for problem in outcomes if problem]
        if problems:
            for slot in slots:
                self._shutdown(slot, grace_s=0.0)
                self._release(slot)
            raise HandlerError(f"a worker process could not load the model: {problems[0]}")
        return slots

    def serve(self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot) -> None:
        try:
            pool.serve(slot)
        except Exception:
            log.exception("model=%s version=%s worker %d failed", pool.model, pool.version, slot.id)
        finally:
            self._shutdown(slot, self._policy.stop_grace_s)
            self._release(slot)
            slot.state = WorkerState.STOPPED

    def prepare(self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot) -> bool:
        while slot.child is None or not slot.child.process.is_alive():
            if slot.child is not None:
                self._lost(pool, slot, [], "while idle")
            if not self._restart(pool, slot):
                return False
        if slot.state is WorkerState.RESTARTING:
            slot.state = WorkerState.READY  # woken for a death that was not its own
        return True

    def run(
        self,
        pool: WorkerPool[ProcessSlot],
        slot: ProcessSlot,
        requests: list[InferenceRequest],
        times: StageTimes,
        parts: PartSink,
    ) -> list[InferenceResponse]:
        child = slot.child
        if child is None:  # `prepare` gave it one; `stop` may have ended it since
            raise WorkerLost(ModelNotReady("the model was stopped before this request ran"))
        try:
            responses = exchange(
                slot,
                child,
                requests,
                times,
                parts,
                timeout_s=self._timeout_s,
                metrics=self._context.metrics,
            )
        except WorkerGone as exc:
            when = f"({exc}) while running this request"
            raise WorkerLost(self._lost(pool, slot, requests, when)) from None
        except WorkerHung:
            raise WorkerLost(self._hung(pool, slot, requests)) from None
        except (TypeError, ValueError, AttributeError, OSError, pickle.PicklingError) as exc:
            # A request whose parameters cannot be described; the worker itself is fine.
            log.exception(
                "model=%s version=%s request_ids=%s could not hand a batch over",
                pool.model,
                pool.version,
                ",".join(r.request_id for r in requests),
            )
            slot.state = WorkerState.READY
            message = f"the request could not be sent to the worker process ({type(exc).__name__})"
            raise WorkerLost(InferenceFailed(message)) from None
        slot.crashes_in_row = 0
        return responses

    def watch(self, pool: WorkerPool[ProcessSlot]) -> None:
        """Notice processes that die while idle, so readiness drops and the slot replaces them."""
        while not pool.closed.is_set():
            watched: dict[int, tuple[ProcessSlot, Child]] = {}
            for slot in pool.slots():
                child = slot.child
                if child is not None and slot.state is WorkerState.READY:
                    watched[child.process.sentinel] = (slot, child)
            if not watched:
                pool.closed.wait(_WATCH_INTERVAL_S)
                continue
            try:
                dead = wait(list(watched), _WATCH_INTERVAL_S)
            except (OSError, ValueError):  # a sentinel closed while waiting: look again
                continue
            for sentinel in dead:
                slot, child = watched[sentinel]  # type: ignore[index]
                # Only if that process is still the slot's: this thread may run late, after
                # the slot's thread has already replaced it.
                if slot.child is child and slot.state is WorkerState.READY:
                    slot.state = WorkerState.RESTARTING
                    slot.wake.set()
                    pool.batcher.wake_all()

    def release(
        self, pool: WorkerPool[ProcessSlot], slots: list[ProcessSlot], deadline: float
    ) -> None:
        for slot in slots:
            self._shutdown(slot, grace_s=0.0)  # a slot thread still waiting on a hung worker
        for slot in slots:
            if slot.thread is not None:
                slot.thread.join(max(0.0, deadline - monotonic()))
            self._release(slot)

    def describe(self, slot: ProcessSlot) -> dict[str, object]:
        return {"pid": slot.pid, "mode": "process"}

    def profile(
        self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot, capture: Capture | None
    ) -> None:
        follow_capture(slot, capture, pool.model, pool.version)

    # -- one worker process ------------------------------------------------------------------
    def _start(self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot) -> str | None:
        """Start the slot's worker process; None, else why none could be started."""
        slot.state = WorkerState.STARTING
        slot.profiling = False  # a new process runs no profiler
        spec = ChildSpec(
            context=replace(self._context, device=slot.device),
            log_level=logging.getLogger().getEffectiveLevel(),
            log_format=current_format(),
            worker=slot.id,
            warmup_runs=self._warmup_runs,
        )
        try:
            slot.child = spawn(spec, name=f"scriptserve-worker-{pool.model}-{slot.id}")
        except (OSError, EOFError) as exc:  # no process: out of descriptors or processes
            slot.child = None
            return f"the worker process could not be started ({_reason(exc)})"
        return None

    def _await_ready(self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot) -> str | None:
        """None once the worker has loaded its handler, else what went wrong."""
        child = slot.child
        if child is None:
            return "the worker process was stopped while loading the model"
        try:
            reply = child.receive(monotonic() + START_TIMEOUT_S)
        except WorkerGone as exc:
            return f"the worker process {exc} while loading the model"
        except WorkerHung:
            return f"the worker process did not load the model within {START_TIMEOUT_S:g} s"
        if reply[0] == "error":
            return str(reply[1])
        slot.warmup = reply[2]
        slot.state = WorkerState.READY
        log.info(
            "model=%s version=%s worker %d ready (pid %s)",
            pool.model,
            pool.version,
            slot.id,
            slot.pid,
        )
        return None

    def _shutdown(self, slot: ProcessSlot, grace_s: float) -> None:
        """End the slot's worker process: ask it to exit, kill it after `grace_s`."""
        with slot.lock:
            child, slot.child = slot.child, None
        if child is not None:
            child.end(grace_s)

    def _release(self, slot: ProcessSlot) -> None:
        for segment in (slot.requests, slot.responses):
            frames.release_segment(segment)

    # -- failures ----------------------------------------------------------------------------
    def _lost(
        self,
        pool: WorkerPool[ProcessSlot],
        slot: ProcessSlot,
        requests: list[InferenceRequest],
        when: str,
    ) -> ServingError:
        """The worker process died: count the crash (the slot's thread replaces it); returns
        the error that answers the requests it was running."""
        slot.state = WorkerState.RESTARTING
        child = slot.child
        how = child.ended() if child is not None else exit_description(None)
        self._shutdown(slot, grace_s=0.0)
        if pool.closed.is_set():  # ended by `stop` after the drain timeout
            return ModelNotReady("the model was stopped before this request finished")
        log.error(
            "model=%s version=%s request_ids=%s worker %d died (%s)",
            pool.model,
            pool.version,
            ",".join(r.request_id for r in requests) or "-",
            slot.id,
            how,
        )
        self._crashed(pool, slot, f"a worker died ({how})")
        return ModelNotReady(f"worker for model {pool.model!r} died {when}; retry")

    def _hung(
        self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot, requests: list[InferenceRequest]
    ) -> ServingError:
        slot.state = WorkerState.RESTARTING
        log.error(
            "model=%s version=%s request_ids=%s worker %d (pid %s) did not answer within the "
            "response timeout of %g s; killing it",
            pool.model,
            pool.version,
            ",".join(r.request_id for r in requests),
            slot.id,
            slot.pid,
            self._timeout_s,
        )
        self._shutdown(slot, grace_s=0.0)
        self._crashed(
            pool, slot, f"a worker hung past the response timeout of {self._timeout_s:g} s"
        )
        return DeadlineExceeded(
            f"the worker for model {pool.model!r} did not answer within the response timeout "
            f"of {self._timeout_s:g} s; it was stopped and is being replaced"
        )

    def _crashed(self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot, reason: str) -> None:
        slot.crashes_in_row += 1
        now = monotonic()
        window = self._policy.restart_window_s
        with self._crash_lock:
            self._crashes.append(now)
            while self._crashes and self._crashes[0] < now - window:
                self._crashes.popleft()
            crashes = len(self._crashes)
        if crashes > self._policy.max_restarts:
            pool.fail(
                f"{crashes} worker failures within {window:g} s, the last: {reason}; "
                "unregister and register the model again"
            )
        elif pool.live == 0:
            # Nobody is left to run what is queued: answer now rather than at each deadline.
            pool.fail_queued(
                ModelNotReady(
                    f"model {pool.model!r} has no live worker ({reason}); "
                    "a replacement is starting; retry"
                )
            )

    def _restart(self, pool: WorkerPool[ProcessSlot], slot: ProcessSlot) -> bool:
        """Replace the slot's process after its back-off; False when it should not come back."""
        if pool.failed_reason is not None or slot.stop.is_set():
            return False
        slot.state = WorkerState.RESTARTING
        delay = self._policy.backoff(slot.crashes_in_row)
        log.warning(
            "model=%s version=%s replacing worker %d in %.2g s (crash %d in a row)",
            pool.model,
            pool.version,
            slot.id,
            delay,
            slot.crashes_in_row,
        )
        if slot.stop.wait(delay):
            return False
        problem = self._start(pool, slot) or self._await_ready(pool, slot)
        if problem is not None:
            log.error(
                "model=%s version=%s replacement worker failed: %s",
                pool.model,
                pool.version,
                problem,
            )
            self._shutdown(slot, grace_s=0.0)
            slot.state = WorkerState.RESTARTING
            self._crashed(pool, slot, problem)
            return pool.failed_reason is None
        pool.metrics.worker_restarts.inc()
        return True


def _reason(exc: Exception) -> str:
    """What stopped a worker process from starting, in words without paths or names."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return "the fork server went away" if isinstance(exc, EOFError) else type(exc).__name__
