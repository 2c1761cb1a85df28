"""A worker process's part in a profiling capture (server/models/profiling.py): its own
profiler, started for a capture that is on and ended, its trace handed over, when the capture
ends."""

from __future__ import annotations

import logging
from time import monotonic

from scriptserve.server.workers.capture import PROFILER_TIMEOUT_S, Capture
from scriptserve.server.workers.process.child_process import WorkerGone, WorkerHung
from scriptserve.server.workers.process.slot import ProcessSlot

log = logging.getLogger("scriptserve.workers.process")


def follow_capture(slot: ProcessSlot, capture: Capture | None, model: str, version: str) -> None:
    """Start the worker process's profiler for a capture that is on, or end it and hand
    its trace to the capture. A worker lost meanwhile has nothing to hand: its
    replacement starts without a profiler, and `prepare` deals with the loss."""
    child = slot.child
    wanted = capture is not None and not capture.done.is_set()
    if child is None or wanted == slot.profiling:
        return
    deadline = monotonic() + PROFILER_TIMEOUT_S
    try:
        if capture is not None and wanted:
            child.send(("profile", capture.settings))
            problem = child.receive(deadline)[1]
            if problem is None:
                slot.profiling = True
                capture.joined(slot.id)
            else:
                capture.handed(slot.id, None, f"worker {slot.id}: {problem}")
            return
        slot.profiling = False
        if capture is None:  # the capture gave up waiting: end the profiler, drop its trace
            child.send(("profile-end", None))
            child.receive(deadline)
            return
        trace = capture.trace_of(slot.id)
        child.send(("profile-end", str(trace)))
        problem = child.receive(deadline)[1]
        capture.handed(slot.id, None if problem else trace, problem)
    except (WorkerGone, WorkerHung) as exc:
        log.warning(
            "model=%s version=%s worker %d lost while profiling: %s",
            model,
            version,
            slot.id,
            exc,
        )
        if capture is not None:
            capture.handed(slot.id, None, f"worker {slot.id} was lost while profiling")
