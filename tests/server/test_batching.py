"""DynamicBatcher on its own: queue bounds, batch formation, delays, deadlines, cancellation,
and waiting for the queue to empty."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.codec import oip_json
from scriptserve.server.errors import ModelNotReady, QueueFull
from scriptserve.server.workers.batching import Batch, DynamicBatcher, Job, decode_jobs

JobFactory = Callable[..., Job]


@pytest.fixture
def make_job() -> Iterator[JobFactory]:
    """Jobs whose futures belong to a real (idle) event loop; the batcher only stores them."""
    loop = asyncio.new_event_loop()

    def make(deadline_in_s: float = 60.0) -> Job:
        return Job(InferenceRequest(), loop.create_future(), time.monotonic() + deadline_in_s)

    yield make
    loop.close()


def in_thread(batcher: DynamicBatcher, stop: threading.Event | None = None) -> queue.Queue[Batch]:
    """Call next_batch from another thread; its batch arrives on the returned queue."""
    out: queue.Queue[Batch] = queue.Queue()
    event = stop or threading.Event()
    threading.Thread(target=lambda: out.put(batcher.next_batch(event)), daemon=True).start()
    return out


def test_delay_zero_returns_what_is_queued_up_to_the_batch_size_without_waiting(
    make_job: JobFactory,
) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
    jobs = [make_job() for _ in range(6)]
    for job in jobs:
        batcher.put(job)
    assert batcher.depth == 6

    started = time.monotonic()
    first = batcher.next_batch(threading.Event())
    second = batcher.next_batch(threading.Event())
    assert time.monotonic() - started < 0.1
    assert first.jobs == jobs[:4]
    assert second.jobs == jobs[4:]
    assert first.expired == second.expired == []
    assert batcher.depth == 0


def test_delay_zero_blocked_worker_takes_a_lone_job_at_once(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=8, max_batch_delay_s=0, max_queue_size=100)
    out = in_thread(batcher)
    job = make_job()
    submitted = time.monotonic()
    batcher.put(job)
    batch = out.get(timeout=5)
    assert batch.jobs == [job]
    assert job.taken
    assert job.dequeued - submitted < 0.5


def test_delay_waits_for_more_until_the_first_job_is_that_old(make_job: JobFactory) -> None:
    delay = 0.2
    batcher = DynamicBatcher(max_batch_size=8, max_batch_delay_s=delay, max_queue_size=100)
    first = make_job()
    batcher.put(first)
    out = in_thread(batcher)
    second = make_job()
    batcher.put(second)
    batch = out.get(timeout=5)
    returned = time.monotonic()
    assert batch.jobs == [first, second]
    assert returned - first.enqueued >= delay
    # The wait counts as queueing: a job is taken when its batch is handed to the worker.
    assert first.dequeued - first.enqueued >= delay


def test_delay_returns_early_when_the_batch_is_full(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=3, max_batch_delay_s=30.0, max_queue_size=100)
    jobs = [make_job() for _ in range(4)]
    batcher.put(jobs[0])
    out = in_thread(batcher)
    for job in jobs[1:]:
        batcher.put(job)
    batch = out.get(timeout=5)  # long before the 30 s delay
    assert batch.jobs == jobs[:3]
    assert batcher.depth == 1


def test_full_queue_raises_queue_full_with_retry_after(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=2)
    batcher.put(make_job())
    batcher.put(make_job())
    with pytest.raises(QueueFull) as info:
        batcher.put(make_job())
    assert info.value.status == 503
    assert info.value.headers["Retry-After"].isdigit()
    assert "full" in info.value.message
    assert batcher.depth == 2


def test_cancel_frees_the_slot_and_the_job_is_never_returned(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=2)
    gone, kept = make_job(), make_job()
    batcher.put(gone)
    batcher.put(kept)
    batcher.cancel(gone)
    assert batcher.depth == 1
    late = make_job()
    batcher.put(late)  # fits: the cancelled job's slot is free
    batcher.cancel(gone)  # cancelling twice changes nothing
    assert batcher.depth == 2
    batch = batcher.next_batch(threading.Event())
    assert batch.jobs == [kept, late]
    assert not gone.taken
    batcher.cancel(kept)  # already taken: the worker runs it, the count stays right
    assert batcher.depth == 0


def test_expired_jobs_come_back_separately(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
    late, live = make_job(deadline_in_s=-1.0), make_job()
    batcher.put(late)
    batcher.put(live)
    batch = batcher.next_batch(threading.Event())
    assert batch.jobs == [live]
    assert batch.expired == [late]
    assert batcher.depth == 0


def test_only_expired_jobs_still_wake_the_worker(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
    out = in_thread(batcher)
    late = make_job(deadline_in_s=-1.0)
    batcher.put(late)
    batch = out.get(timeout=5)
    assert batch.jobs == []
    assert batch.expired == [late]


def test_take_all_empties_the_queue(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
    jobs = [make_job() for _ in range(5)]
    for job in jobs:
        batcher.put(job)
    batcher.cancel(jobs[2])
    taken = batcher.take_all()
    assert taken == [jobs[0], jobs[1], jobs[3], jobs[4]]
    assert batcher.depth == 0
    stop = threading.Event()
    stop.set()
    assert batcher.next_batch(stop).jobs == []


def test_close_refuses_new_jobs_but_hands_out_queued_ones(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
    queued = make_job()
    batcher.put(queued)
    batcher.close()
    with pytest.raises(ModelNotReady) as info:
        batcher.put(make_job())
    assert info.value.status == 503
    assert batcher.next_batch(threading.Event()).jobs == [queued]


@pytest.mark.parametrize("wake", [True, False], ids=["woken", "polling"])
def test_stop_makes_a_blocked_next_batch_return_empty(make_job: JobFactory, wake: bool) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
    stop = threading.Event()
    out: queue.Queue[Batch] = queue.Queue()
    thread = threading.Thread(
        target=lambda: out.put(batcher.next_batch(stop, poll_s=0.05 if not wake else 30.0))
    )
    thread.start()
    stop.set()
    if wake:
        batcher.wake_all()  # what WorkerPool does after setting a worker's stop event
    started = time.monotonic()
    batch = out.get(timeout=5)
    assert time.monotonic() - started < 1.0
    assert batch.jobs == batch.expired == []
    thread.join(5)


def test_stop_during_the_delay_returns_what_was_taken(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=30.0, max_queue_size=100)
    job = make_job()
    batcher.put(job)
    stop = threading.Event()
    out = in_thread(batcher, stop)
    # Wait (polling, with a deadline) until the worker holds the job, then stop it.
    deadline = time.monotonic() + 5
    while not job.taken and time.monotonic() < deadline:
        time.sleep(0.005)
    stop.set()
    batcher.wake_all()
    assert out.get(timeout=5).jobs == [job]  # a taken job is run, never lost


def test_concurrent_consumers_take_every_job_exactly_once(make_job: JobFactory) -> None:
    total = 1000
    batcher = DynamicBatcher(max_batch_size=7, max_batch_delay_s=0, max_queue_size=total)
    stop = threading.Event()
    seen: list[list[Job]] = [[] for _ in range(4)]
    sizes: list[int] = []

    def consume(mine: list[Job]) -> None:
        while not stop.is_set():
            batch = batcher.next_batch(stop, poll_s=0.01)
            sizes.append(len(batch.jobs))
            mine.extend(batch.jobs)

    threads = [threading.Thread(target=consume, args=(s,)) for s in seen]
    for t in threads:
        t.start()
    jobs = [make_job() for _ in range(total)]
    for job in jobs:
        batcher.put(job)
    deadline = time.monotonic() + 30
    while sum(map(len, seen)) < total and time.monotonic() < deadline:
        time.sleep(0.005)
    stop.set()
    batcher.wake_all()
    for t in threads:
        t.join(5)
    taken = [id(j) for s in seen for j in s]
    assert len(taken) == total
    assert set(taken) == {id(j) for j in jobs}
    assert max(sizes) <= 7
    assert batcher.depth == 0


def waiting_for_empty(batcher: DynamicBatcher, timeout_s: float = 10.0) -> queue.Queue[bool]:
    """Call wait_empty from another thread; what it returns arrives on the returned queue."""
    out: queue.Queue[bool] = queue.Queue()
    threading.Thread(target=lambda: out.put(batcher.wait_empty(timeout_s)), daemon=True).start()
    return out


def test_wait_empty_returns_at_once_when_nothing_waits(make_job: JobFactory) -> None:
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0, max_queue_size=100)
    assert batcher.wait_empty(0.0)
    batcher.put(make_job())
    started = time.monotonic()
    assert not batcher.wait_empty(0.05)  # a job still waits: it gives up at its timeout
    assert time.monotonic() - started >= 0.05


@pytest.mark.parametrize("how", ["taken", "cancelled", "take_all"])
def test_wait_empty_wakes_when_the_last_job_leaves(make_job: JobFactory, how: str) -> None:
    batcher = DynamicBatcher(max_batch_size=2, max_batch_delay_s=0, max_queue_size=100)
    jobs = [make_job() for _ in range(3)]
    for job in jobs:
        batcher.put(job)
    out = waiting_for_empty(batcher)
    if how == "taken":
        assert len(batcher.next_batch(threading.Event()).jobs) == 2
        assert out.empty()  # one job still waits
        last = batcher.next_batch(threading.Event())
        assert last.jobs == jobs[2:]
    elif how == "cancelled":
        for job in jobs:
            batcher.cancel(job)
    else:
        batcher.take_all()
    assert out.get(timeout=5) is True
    assert batcher.depth == 0


# -- decoding a batch's requests --------------------------------------------------------------


class _Decoding:
    """What is queued for a request sent as it was (as `admission.Deferred` is): the call that
    decodes it, and the wire object it decodes from."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self) -> InferenceRequest:
        request: InferenceRequest = self.source.decode()
        return request


def _oip(data: str) -> oip_json.OipBody:
    tensor = '{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": ' + data + "}"
    return oip_json.OipBody(('{"inputs": [' + tensor + "]}").encode(), None, {})


def test_decode_jobs_reads_the_oip_bodies_of_a_batch_together(make_job: JobFactory) -> None:
    oip_json._ENVELOPES.clear()
    _oip("[0, 0]").decode()  # the envelope is remembered
    jobs = [make_job() for _ in range(3)]
    for job, data in zip(jobs, ("[1, 2]", "[3, 4]", "[5]"), strict=True):
        job.decode = _Decoding(_oip(data))

    runnable, failed = decode_jobs(jobs, "m", "1")

    oip_json._ENVELOPES.clear()
    # [5] does not fit the envelope's shape: nothing is read together, each decodes alone.
    assert [job.request.inputs["x"].tolist() for job in runnable] == [[[1.0, 2.0]], [[3.0, 4.0]]]
    assert [(job, error.status) for job, error in failed] == [(jobs[2], 400)]
    assert "needs 2 values, got 1" in failed[0][1].message
    assert all(job.decode is None for job in jobs)


def test_decode_jobs_parses_fitting_bodies_once(make_job: JobFactory) -> None:
    oip_json._ENVELOPES.clear()
    _oip("[0, 0]").decode()
    jobs = [make_job() for _ in range(2)]
    for job, data in zip(jobs, ("[1, 2]", "[3, 4]"), strict=True):
        job.decode = _Decoding(_oip(data))

    runnable, failed = decode_jobs(jobs, "m", "1")

    oip_json._ENVELOPES.clear()
    assert failed == []
    first, second = (job.request.inputs["x"] for job in runnable)
    assert second.tolist() == [[3.0, 4.0]]
    assert np.shares_memory(first.base, second)


class _CannotReadTogether:
    @staticmethod
    def read_together(sources: list[object]) -> None:
        raise RuntimeError("a bug in reading together")

    def decode(self) -> InferenceRequest:
        return InferenceRequest(request_id="alone")


def test_a_failure_to_read_together_is_logged_and_each_job_decodes_alone(
    make_job: JobFactory, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = [make_job() for _ in range(2)]
    for job in jobs:
        job.decode = _Decoding(_CannotReadTogether())

    runnable, failed = decode_jobs(jobs, "m", "1")

    assert [job.request.request_id for job in runnable] == ["alone", "alone"]
    assert failed == []
    assert "model=m version=1 reading 2 requests together failed" in caplog.text
