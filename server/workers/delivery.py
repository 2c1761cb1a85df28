"""How a worker's outcomes reach the requests' futures: each made into what its future holds on
the worker's thread (`settled`), then handed to the event loop in one call per batch. And the
record a traced batch leaves on its jobs."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.errors import InferenceFailed, ServingError, error_for_status
from scriptserve.server.workers.batching import BatchRecord, Job

log = logging.getLogger("scriptserve.workers")


def settled(job: Job, outcome: object) -> object:
    """What `job`'s future is to hold for a worker's outcome, made on the worker's thread: the
    job's `finish` of a successful InferenceResponse, else the ServingError that answers it (a
    response with `error` set becomes the error for its status; anything that is not a response,
    InferenceFailed)."""
    if isinstance(outcome, ServingError):
        return outcome
    if not isinstance(outcome, InferenceResponse):
        return InferenceFailed(f"the worker answered with a {type(outcome).__name__}")
    if outcome.error is not None:
        return error_for_status(outcome.status, outcome.error)
    if job.finish is None:
        return outcome
    try:
        return job.finish(outcome)
    except ServingError as exc:
        return exc
    except Exception:
        log.exception("request_id=%s its answer could not be made", job.request.request_id)
        return InferenceFailed("the model's answer could not be made; see the server's log")


def deliver(outcomes: Sequence[tuple[Job, object]]) -> None:
    """Runs on the event loop: resolve the futures nobody has given up on with what `settled`
    made of their outcomes, the one place where a request's future is resolved."""
    for job, value in outcomes:
        if job.future.done():
            continue
        if isinstance(value, BaseException):
            job.future.set_exception(value)
        else:
            job.future.set_result(value)


def hand_back(jobs: list[Job], outcomes: Sequence[object]) -> None:
    """From any thread: settle one outcome per job here, then have the event loop `deliver`
    them, in one call."""
    if jobs:
        pairs = [(job, settled(job, outcome)) for job, outcome in zip(jobs, outcomes, strict=True)]
        jobs[0].future.get_loop().call_soon_threadsafe(deliver, pairs)


def traced(jobs: list[Job], worker: int, started: float) -> BatchRecord | None:
    """The record of a batch the worker took at `started` (time.monotonic(), before decoding
    its requests: decoding is the batch's input stage), left on its traced jobs, when it has
    any."""
    for job in jobs:
        if job.span_context is not None:
            break
    else:
        return None  # the usual case: no list made
    traced_jobs = [job for job in jobs if job.span_context is not None]
    record = BatchRecord(
        [job.request.request_id for job in jobs],
        [(job.span_context, job.request.request_id) for job in traced_jobs],
        worker,
        started,
    )
    for job in traced_jobs:
        job.batch = record
    return record


def fail_jobs(jobs: list[Job], error: ServingError) -> None:
    """Answer `jobs` with `error` (from any thread); futures already done are left alone."""
    hand_back(jobs, [error] * len(jobs))
