"""The data plane's deadlines (server/inference/deadlines.py) on a real event loop and batcher:
a request is expired at its own deadline, in whatever order deadlines arrive, and one answered
first is never expired; answered entries do not pile up."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.errors import DeadlineExceeded
from scriptserve.server.inference.deadlines import Deadlines
from scriptserve.server.workers.batching import DynamicBatcher, Job


def queued(batcher: DynamicBatcher, budget_s: float) -> Job:
    job = Job(InferenceRequest(), asyncio.get_running_loop().create_future(), time.monotonic())
    job.deadline += budget_s
    batcher.put(job)
    return job


async def expired_after(job: Job) -> float:
    """Seconds until `job`'s future ended; it must end with the 504."""
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as ended:
        await asyncio.wait_for(job.future, 5)
    assert "deadline of" in ended.value.message
    return time.monotonic() - started


def test_each_request_is_expired_at_its_own_deadline_whatever_the_order_they_came() -> None:
    async def run() -> None:
        deadlines = Deadlines()
        batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
        late = queued(batcher, 0.6)
        deadlines.add(late, batcher, 0.6)
        early = queued(batcher, 0.2)  # a client's shorter deadline, after a later one
        deadlines.add(early, batcher, 0.2)
        answered = queued(batcher, 0.1)
        entry = deadlines.add(answered, batcher, 0.1)
        answered.future.set_result(None)  # as its worker answers it
        batcher.cancel(answered)  # (here no worker took it from the queue)
        deadlines.remove(entry)
        early_s, late_s = await asyncio.gather(expired_after(early), expired_after(late))
        assert 0.15 <= early_s <= 0.45, early_s
        assert 0.55 <= late_s <= 0.85, late_s
        assert answered.future.result() is None  # answered first: never expired
        assert batcher.depth == 0  # the expired ones were withdrawn from the queue
        assert len(deadlines) == 0

    asyncio.run(run())


def test_answered_requests_do_not_pile_up() -> None:
    """Entries of answered requests are dropped once they outnumber the waiting ones, so the
    heap stays within a small multiple of the requests in flight."""

    async def run() -> None:
        deadlines = Deadlines()
        batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=10_000)
        waiting = [queued(batcher, 60) for _ in range(10)]
        for job in waiting:
            deadlines.add(job, batcher, 60)
        for _ in range(5_000):
            job = queued(batcher, 60)
            entry = deadlines.add(job, batcher, 60)
            batcher.cancel(job)
            deadlines.remove(entry)
            deadlines.remove(entry)  # twice, as an answer and a withdrawal may both remove it
        assert len(deadlines) == 10
        assert len(deadlines._heap) <= 2 * 256 + 10
        assert not any(job.future.done() for job in waiting)

    asyncio.run(run())


def test_a_deadline_set_on_another_loop_is_kept_on_the_new_one() -> None:
    """A data plane that outlives an event loop (a server started again in one process) still
    expires requests on the loop they came on; those left from the ended loop are dropped when
    their deadlines come, not answered on a loop that is closed."""
    deadlines = Deadlines()

    async def one() -> float:
        batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=10)
        job = queued(batcher, 0.1)
        deadlines.add(job, batcher, 0.1)
        return await expired_after(job)

    async def abandoned() -> None:
        batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=10)
        for budget_s in (30, 0.05):  # its loop ends with them pending, the second due first
            job = queued(batcher, budget_s)
            job.future.add_done_callback(lambda _: None)  # as the data plane's `Call.end` is
            deadlines.add(job, batcher, budget_s)

    asyncio.run(abandoned())
    assert asyncio.run(one()) <= 0.5


def test_a_timer_that_fires_early_is_not_set_again_and_again() -> None:
    """uvloop's timers fire up to a millisecond before their time (its clock counts
    milliseconds); a deadline that near is due, so each deadline takes one turn of the timer,
    not one turn per loop iteration until the clock reaches it (about a hundred each before)."""
    turns = 0

    class Counted(Deadlines):
        def _due(self, loop: asyncio.AbstractEventLoop) -> None:
            nonlocal turns
            turns += 1
            super()._due(loop)

    async def run() -> None:
        deadlines = Counted()
        batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
        for i in range(20):
            job = queued(batcher, 1)
            deadlines.add(job, batcher, 0.0034 + i * 0.0001)  # between two of the clock's ticks
            with pytest.raises(DeadlineExceeded):
                await job.future

    uvloop.run(run())
    assert turns <= 20 + 2, turns
