"""How a worker's outcomes reach the requests' futures: from any thread, handed to the event loop
in one call per batch, where each becomes what its future holds. And the record a traced batch
leaves on its jobs."""

from __future__ import annotations

import time
from collections.abc import Sequence

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.errors import InferenceFailed, ServingError, error_for_status
from scriptserve.server.workers.batching import BatchRecord, Job


def deliver(outcomes: Sequence[tuple[Job, object]]) -> None:
    """Runs on the event loop: resolve the futures nobody has given up on.

    The one place where a worker's outcome becomes what a request's future holds: a successful
    InferenceResponse, or a ServingError (a response with `error` set becomes the error for its
    status; anything that is not a response becomes InferenceFailed).
    """
    for job, outcome in outcomes:
        if job.future.done():
            continue
        if isinstance(outcome, ServingError):
            job.future.set_exception(outcome)
        elif not isinstance(outcome, InferenceResponse):
            job.future.set_exception(
                InferenceFailed(f"the worker answered with a {type(outcome).__name__}")
            )
        elif outcome.error is not None:
            job.future.set_exception(error_for_status(outcome.status, outcome.error))
        else:
            job.future.set_result(outcome)


def hand_back(jobs: list[Job], outcomes: Sequence[object]) -> None:
    """From any thread: have the event loop `deliver` one outcome per job."""
    if jobs:
        pairs = list(zip(jobs, outcomes, strict=True))
        jobs[0].future.get_loop().call_soon_threadsafe(deliver, pairs)


def traced(jobs: list[Job], worker: int) -> BatchRecord | None:
    """The record of a batch starting now, left on its jobs, when one of them is traced."""
    for job in jobs:
        if job.span_context is not None:
            record = BatchRecord(jobs, worker, time.monotonic())
            for each in jobs:
                each.batch = record
            return record
    return None


def fail_jobs(jobs: list[Job], error: ServingError) -> None:
    """Answer `jobs` with `error` (from any thread); futures already done are left alone."""
    hand_back(jobs, [error] * len(jobs))
