"""ThreadRunner: workers that are threads of the server, calling the handler themselves.

Each worker is bound to a device (`cpu`, or `cuda:N` round-robin). Handlers whose class is
`thread_safe` are built once per device and shared by that device's workers (one copy of the
weights); others get one instance per worker.

Before a worker joins the pool it runs the archive's sample input (`warmup.warm_up`), so the
model reports ready with warm workers.

A watchdog notices a worker stuck in one handler call past the response timeout. A thread cannot
be killed: the stuck one is abandoned (its result is dropped when it returns; its clients have
had their 504 from the data plane's timer) and a new worker takes its place. Until the new one
has its handler, the place counts as missing (`live < size`: the model is not ready); a new
worker that cannot start is tried again after the restart policy's back-off. With more than
`max_abandoned` abandoned threads still stuck, the model is marked FAILED.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
    StageTimes,
    load_failure,
    run_batch,
)
from scriptserve.handlers.loader import worker_scope
from scriptserve.handlers.parts import PartSink
from scriptserve.server.workers.capture import Capture
from scriptserve.server.workers.pool import RestartPolicy, Slot, WorkerPool, WorkerState
from scriptserve.server.workers.warmup import warm_up

log = logging.getLogger("scriptserve.workers")

HandlerFactory = Callable[[str], tuple[BaseHandler, Context]]
"""Builds and initializes a handler for a device; blocking (loads the model)."""


def own_threads(intra_op_threads: int) -> None:
    """Give this worker thread its intra-op thread count, when torch runs here.

    OpenMP keeps the count per thread: the loading thread's `torch.set_num_threads` does not
    reach a worker thread started later, whose parallel regions would use every core while
    torch.get_num_threads() still reports the process's value (measured: a TorchScript MLP on
    a new thread used 1.7 cores with 1 asked for). A `.pt2` backend sets its own on its first
    call; torch is not imported here for it.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(intra_op_threads)


@dataclass(eq=False, kw_only=True)
class ThreadSlot(Slot):
    handler: BaseHandler
    context: Context
    replace_after: float = 0.0
    """Once abandoned: time.monotonic() of the next try to start a worker in its place."""
    failed_starts: int = 0


class ThreadRunner:
    mode = "thread"
    reported_states = (WorkerState.READY, WorkerState.BUSY)
    stop_grace_s = 0.0

    def __init__(
        self,
        factory: HandlerFactory,
        response_timeout_s: float | None = None,
        max_abandoned: int = 4,
        policy: RestartPolicy | None = None,
        warmup_runs: int = 0,
    ) -> None:
        self._factory = factory
        self._warmup_runs = warmup_runs
        self._timeout_s = response_timeout_s
        self._max_abandoned = max_abandoned
        self._policy = policy or RestartPolicy()
        self._lock = threading.Lock()
        self._shared: dict[str, tuple[BaseHandler, Context]] = {}
        self._built: list[weakref.ref[BaseHandler]] = []
        self._untracked = 0
        """Handlers that take no weak reference (`__slots__` without `__weakref__`)."""
        self._stuck: list[ThreadSlot] = []

    def handlers_alive(self) -> int:
        """Handlers built by this runner that are still alive: after `stop`, only what a
        reference cycle or a stuck thread holds."""
        return self._untracked + sum(1 for ref in self._built if ref() is not None)

    def idle(self, pool: WorkerPool[ThreadSlot]) -> None:
        with self._lock:
            self._shared.clear()  # its model is freed when the last worker using it stops
            self._built = [ref for ref in self._built if ref() is not None]

    def _handler_for(
        self, pool: WorkerPool[ThreadSlot], device: str
    ) -> tuple[BaseHandler, Context]:
        with self._lock:
            if device in self._shared:
                return self._shared[device]
            try:
                handler, context = self._factory(device)
            except Exception as exc:
                raise load_failure(exc, pool.model, pool.version) from None
            try:
                self._built.append(weakref.ref(handler))
            except TypeError:
                self._untracked += 1
            if handler.thread_safe:
                self._shared[device] = (handler, context)
            return handler, context

    # -- the runner protocol -----------------------------------------------------------------
    def open(self, pool: WorkerPool[ThreadSlot], places: list[tuple[int, str]]) -> list[ThreadSlot]:
        slots = []
        for slot_id, device in places:
            handler, context = self._handler_for(pool, device)
            # On this (loading) thread: what a model sets up on its first calls serves the
            # worker thread too (TorchScript's first call on another thread after warm-up costs
            # about what a steady one does: benchmarks/README.md).
            with worker_scope(handler):
                warmup = warm_up(handler, context, self._warmup_runs, slot_id)
            slots.append(
                ThreadSlot(
                    id=slot_id,
                    device=device,
                    state=WorkerState.READY,
                    warmup=warmup,
                    handler=handler,
                    context=context,
                )
            )
        return slots

    def serve(self, pool: WorkerPool[ThreadSlot], slot: ThreadSlot) -> None:
        own_threads(slot.context.intra_op_threads)
        try:
            with worker_scope(slot.handler):
                pool.serve(slot)
        except Exception:
            log.exception("model=%s version=%s worker %d failed", pool.model, pool.version, slot.id)
        finally:
            if not slot.abandoned:  # an abandoned one keeps its place until it is replaced
                slot.state = WorkerState.STOPPED

    def prepare(self, pool: WorkerPool[ThreadSlot], slot: ThreadSlot) -> bool:
        return True

    def run(
        self,
        pool: WorkerPool[ThreadSlot],
        slot: ThreadSlot,
        requests: list[InferenceRequest],
        times: StageTimes,
        parts: PartSink,
    ) -> list[InferenceResponse]:
        responses = run_batch(slot.handler, requests, slot.context, times, parts)
        if slot.abandoned:
            log.warning(
                "model=%s version=%s request_ids=%s worker %d returned after %.1f s, past its "
                "response timeout; its result was dropped",
                pool.model,
                pool.version,
                ",".join(r.request_id for r in requests),
                slot.id,
                time.monotonic() - slot.busy_since,
            )
        return responses

    def release(
        self, pool: WorkerPool[ThreadSlot], slots: list[ThreadSlot], deadline: float
    ) -> None:
        # Nothing of the model stays reachable from here: refcounting frees its handlers.
        with self._lock:
            self._shared.clear()
        self._stuck.clear()

    def describe(self, slot: ThreadSlot) -> dict[str, object]:
        return {}

    def profile(
        self, pool: WorkerPool[ThreadSlot], slot: ThreadSlot, capture: Capture | None
    ) -> None:
        """Nothing to do: the server's own profiler records its threads."""

    # -- the watchdog ------------------------------------------------------------------------
    def watch(self, pool: WorkerPool[ThreadSlot]) -> None:
        if self._timeout_s is None:
            pool.closed.wait()
            return
        timeout = self._timeout_s
        interval = min(1.0, max(0.05, timeout / 4))
        while not pool.closed.wait(interval):
            if pool.failed_reason is None:
                self._look(pool, timeout)

    def _look(self, pool: WorkerPool[ThreadSlot], timeout: float) -> None:
        """One round of the watchdog. A function of its own, so that no slot stays referenced
        from the watchdog's locals while it waits: a slot scaled away holds its handler, and
        with it the model, which must be freed when the model is unloaded."""
        now = time.monotonic()
        for slot in pool.slots():
            if slot.abandoned:
                if now >= slot.replace_after:
                    self._replace(pool, slot)
            elif slot.state is WorkerState.BUSY and now - slot.busy_since > timeout:
                self._abandon(pool, slot, now - slot.busy_since)

    def _abandon(self, pool: WorkerPool[ThreadSlot], slot: ThreadSlot, stuck_s: float) -> None:
        """Give up a worker stuck in the handler; it stops once (if ever) its call returns."""
        if pool.closed.is_set():
            return
        slot.abandoned = True
        slot.state = WorkerState.RESTARTING
        slot.stop.set()
        slot.wake.set()
        self._stuck = [s for s in self._stuck if s.thread is not None and s.thread.is_alive()]
        self._stuck.append(slot)
        pool.metrics.workers_stuck.inc()
        log.error(
            "model=%s version=%s worker %d stuck in the handler for %.1f s (response timeout "
            "%g s); abandoning the thread (%d abandoned and still stuck)",
            pool.model,
            pool.version,
            slot.id,
            stuck_s,
            self._timeout_s,
            len(self._stuck),
        )
        if len(self._stuck) > self._max_abandoned:
            pool.fail(
                f"{len(self._stuck)} worker threads are stuck in the handler past the response "
                f"timeout of {self._timeout_s:g} s"
            )
            return
        self._replace(pool, slot)

    def _replace(self, pool: WorkerPool[ThreadSlot], old: ThreadSlot) -> None:
        try:
            (new,) = self.open(pool, [(pool.next_id(), old.device)])
        except HandlerError as exc:
            old.failed_starts += 1
            delay = self._policy.backoff(old.failed_starts)
            old.replace_after = time.monotonic() + delay
            log.error(
                "model=%s version=%s could not start a worker in place of worker %d (%s); "
                "trying again in %.2g s",
                pool.model,
                pool.version,
                old.id,
                exc.message,
                delay,
            )
            return
        if pool.replace(old, new):
            pool.metrics.worker_restarts.inc()
