"""WorkerPool with thread workers, in-process: scaling, stop, deadlines, how failures reach a
request's future, stuck workers and their replacement, and handlers shared between threads."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scriptserve.archiver.manifest import Manifest, ModelInfo
from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
)
from scriptserve.server.errors import (
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    ModelNotReady,
    QueueFull,
)
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.workers.batching import DynamicBatcher, Job
from scriptserve.server.workers.delivery import deliver, settled
from scriptserve.server.workers.pool import RestartPolicy, WorkerPool, WorkerState
from scriptserve.server.workers.threads import ThreadRunner, ThreadSlot

pytestmark = pytest.mark.anyio

ANSWER_S = 10.0
"""How long a test waits for something that takes milliseconds before it fails."""
SECRET = "/opt/models/secret-weights.pt"


def context(name: str = "tiny", device: str = "cpu") -> Context:
    manifest = Manifest(ModelInfo(name, "1.0", "tensor"))
    return Context(
        model_name=name, model_version="1.0", model_dir=Path("."), manifest=manifest, device=device
    )


def row(value: float) -> InferenceRequest:
    return InferenceRequest(inputs={"x": np.full((1, 2), value, dtype=np.float32)})


class Doubler(BaseHandler):
    """y = 2x, one instance shared by the workers of a device. A request whose value has a gate
    waits for the gate first (a worker the test keeps busy); 13 fails its own request (400);
    -1 raises an exception whose text holds a path."""

    thread_safe = True

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[float, threading.Event] = {}
        self.ran: list[str] = []

    def initialize(self, context: Context) -> None:
        self.context = context  # no model file: the handler computes y itself

    def handle(self, requests: list[InferenceRequest], context: Context) -> list[InferenceResponse]:
        responses = []
        for request in requests:
            value = float(request.inputs["x"].flat[0])
            if value in self.gates:
                assert self.gates[value].wait(ANSWER_S * 3), "the test never opened the gate"
            if value == -1:
                raise ValueError(f"cannot read {SECRET}")
            self.ran.append(request.request_id)
            if value == 13:
                responses.append(InferenceResponse.failed("13 is not a valid input", 400))
            else:
                responses.append(InferenceResponse(outputs={"y": request.inputs["x"] * 2}))
        return responses


class OwnDoubler(Doubler):
    thread_safe = False  # one instance per worker


@dataclass
class Factory:
    """Builds handlers of `cls`, sharing `gates` and `ran` between them; once `fail_after` were
    built it raises instead (a model that can no longer be loaded)."""

    cls: type[Doubler] = Doubler
    fail_after: int | None = None
    built: list[Doubler] = field(default_factory=list)
    gates: dict[float, threading.Event] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)

    def __call__(self, device: str) -> tuple[BaseHandler, Context]:
        if self.fail_after is not None and len(self.built) >= self.fail_after:
            raise RuntimeError(f"out of device memory loading {SECRET}")
        handler = self.cls()
        handler.gates, handler.ran = self.gates, self.ran
        ctx = context(device=device)
        handler.initialize(ctx)
        self.built.append(handler)
        return handler, ctx

    def gate(self, value: float) -> threading.Event:
        self.gates[value] = threading.Event()
        return self.gates[value]


PoolFactory = Callable[..., WorkerPool[ThreadSlot]]


@pytest.fixture
def thread_pool() -> Iterator[PoolFactory]:
    """Makes pools (no workers until `scale`); each is stopped after the test, its gates open."""
    pools: list[tuple[WorkerPool[ThreadSlot], Factory]] = []

    def make(
        factory: Factory,
        max_batch_size: int = 4,
        response_timeout_s: float | None = None,
        max_abandoned: int = 4,
        devices: list[str] | None = None,
    ) -> WorkerPool[ThreadSlot]:
        batcher = DynamicBatcher(max_batch_size, 0.0, max_queue_size=100)
        policy = RestartPolicy(backoff_s=0.05, backoff_max_s=0.4)
        runner = ThreadRunner(factory, response_timeout_s, max_abandoned, policy)
        metrics = ServerMetrics().for_version("tiny", "1.0")
        pool = WorkerPool("tiny", "1.0", batcher, runner, devices or ["cpu"], metrics)
        pools.append((pool, factory))
        return pool

    yield make
    for pool, factory in pools:
        for gate in getattr(factory, "gates", {}).values():
            gate.set()
        pool.stop(timeout_s=1.0)


def submit(pool: WorkerPool[Any], request: InferenceRequest, deadline_s: float = 60.0) -> Job:
    """Queue a request as the data plane does (from the loop); its answer comes as the future."""
    loop = asyncio.get_running_loop()
    job = Job(request, loop.create_future(), deadline=time.monotonic() + deadline_s)
    pool.batcher.put(job)
    return job


async def answer(job: Job) -> InferenceResponse:
    return await asyncio.wait_for(job.future, ANSWER_S)


async def until(check: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + ANSWER_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {ANSWER_S} s"
        await asyncio.sleep(0.005)


def doubled(response: InferenceResponse, value: float) -> bool:
    return bool(np.array_equal(response.outputs["y"], np.full((1, 2), 2 * value, np.float32)))


# -- scaling -------------------------------------------------------------------------------------
async def test_scaling_up_and_down_serves_every_request(thread_pool: PoolFactory) -> None:
    factory = Factory(cls=OwnDoubler)
    pool = thread_pool(factory)
    await asyncio.to_thread(pool.scale, 2)
    assert (pool.size, pool.live, len(factory.built)) == (2, 2, 2)
    described = pool.describe()
    assert [w["status"] for w in described] == ["READY", "READY"]
    assert len({w["id"] for w in described}) == 2 and {w["device"] for w in described} == {"cpu"}

    await asyncio.to_thread(pool.scale, 3)
    assert (pool.size, pool.live, len(factory.built)) == (3, 3, 3)
    values = [float(v) for v in range(20, 60)]
    jobs = [submit(pool, row(v)) for v in values]
    before = pool.slots()
    await asyncio.to_thread(pool.scale, 1)  # while those requests are queued and running
    for value, job in zip(values, jobs, strict=True):
        assert doubled(await answer(job), value), f"request {value}"
    assert (pool.size, pool.live) == (1, 1)
    retired = [slot for slot in before if slot not in pool.slots()]
    await until(lambda: all(s.state is WorkerState.STOPPED for s in retired), "retired stop")
    assert pool.counts() == {"READY": 1, "BUSY": 0}
    assert doubled(await answer(submit(pool, row(5))), 5)


async def test_thread_safe_handlers_are_built_once_per_device(thread_pool: PoolFactory) -> None:
    factory = Factory()
    pool = thread_pool(factory, devices=["cpu", "cuda:0"])
    await asyncio.to_thread(pool.scale, 4)
    assert len(factory.built) == 2
    by_device: dict[str, set[int]] = {}
    for slot in pool.slots():
        by_device.setdefault(slot.device, set()).add(id(slot.handler))
    assert {d: len(h) for d, h in by_device.items()} == {"cpu": 1, "cuda:0": 1}


async def test_a_worker_that_cannot_load_leaves_the_pool_as_it_was(
    thread_pool: PoolFactory,
) -> None:
    factory = Factory(cls=OwnDoubler, fail_after=2)
    pool = thread_pool(factory)
    await asyncio.to_thread(pool.scale, 1)
    with pytest.raises(HandlerError) as info:
        await asyncio.to_thread(pool.scale, 3)  # the second new worker fails
    assert info.value.message == "the handler failed to load: RuntimeError; see the server log"
    assert (pool.size, pool.live) == (1, 1)
    assert doubled(await answer(submit(pool, row(2))), 2)


# -- stop and deadlines ----------------------------------------------------------------------------
async def test_stop_answers_queued_requests_503_and_finishes_the_running_batch(
    thread_pool: PoolFactory,
) -> None:
    factory = Factory()
    pool = thread_pool(factory, max_batch_size=1)
    await asyncio.to_thread(pool.scale, 1)
    gate = factory.gate(7.0)
    running = submit(pool, row(7.0))
    await until(lambda: running.taken, "the worker took the first request")
    queued = [submit(pool, row(i)) for i in range(3)]

    stopping = asyncio.create_task(asyncio.to_thread(pool.stop, 0.2))
    for job in queued:
        with pytest.raises(ModelNotReady) as info:
            await answer(job)
        assert info.value.status == 503
        assert info.value.message == "the model was stopped before this request ran; retry"
    gate.set()
    await asyncio.wait_for(stopping, ANSWER_S)
    assert doubled(await answer(running), 7.0)  # taken before the stop: run and answered
    assert (pool.size, pool.live) == (0, 0)
    assert [job.request.request_id for job in queued if job.request.request_id in factory.ran] == []


async def test_a_request_past_its_deadline_is_answered_504_without_running(
    thread_pool: PoolFactory,
) -> None:
    factory = Factory()
    pool = thread_pool(factory, max_batch_size=1)
    await asyncio.to_thread(pool.scale, 1)
    gate = factory.gate(7.0)
    busy = submit(pool, row(7.0))
    await until(lambda: busy.taken, "the worker took the first request")
    late = submit(pool, row(1.0), deadline_s=0.05)
    await until(lambda: time.monotonic() > late.deadline, "the deadline passed")
    gate.set()
    with pytest.raises(DeadlineExceeded) as info:
        await answer(late)
    assert info.value.status == 504
    assert "past its deadline" in info.value.message
    assert doubled(await answer(busy), 7.0)
    assert late.request.request_id not in factory.ran


# -- from a handler's outcome to a request's future ------------------------------------------------
async def test_each_future_holds_what_its_outcome_settles_to() -> None:
    loop = asyncio.get_running_loop()
    jobs = [Job(row(i), loop.create_future(), deadline=time.monotonic() + 60) for i in range(8)]
    ok = InferenceResponse(outputs={"y": np.ones((1, 2), np.float32)})
    full = QueueFull("the queue is full")
    jobs[5].future.cancel()  # the client went away
    jobs[6].finish = lambda response: ("answer", response)  # what the data plane makes of it

    def unknown_output(response: InferenceResponse) -> object:
        raise InvalidInput("unknown output(s) z")

    jobs[7].finish = unknown_output
    outcomes = [
        ok,
        InferenceResponse.failed("input 'x' has shape [3]; expected [2]", 400),
        InferenceResponse.failed("the model's output was empty", 500),
        {"y": [1.0, 2.0]},
        full,
        ok,
        ok,
        ok,
    ]
    deliver([(job, settled(job, outcome)) for job, outcome in zip(jobs, outcomes, strict=True)])
    assert jobs[0].future.result() is ok
    bad_input = jobs[1].future.exception()
    assert isinstance(bad_input, InvalidInput) and bad_input.status == 400
    assert bad_input.message == "input 'x' has shape [3]; expected [2]"
    failed = jobs[2].future.exception()
    assert isinstance(failed, InferenceFailed) and failed.status == 500
    assert failed.message == "the model's output was empty"
    not_a_response = jobs[3].future.exception()
    assert isinstance(not_a_response, InferenceFailed)
    assert not_a_response.message == "the worker answered with a dict"
    assert jobs[4].future.exception() is full
    assert jobs[5].future.cancelled()
    assert jobs[6].future.result() == ("answer", ok)
    refused = jobs[7].future.exception()
    assert isinstance(refused, InvalidInput) and refused.message == "unknown output(s) z"


async def test_a_failed_response_fails_only_its_own_request(thread_pool: PoolFactory) -> None:
    factory = Factory()
    pool = thread_pool(factory, max_batch_size=8)
    await asyncio.to_thread(pool.scale, 1)
    gate = factory.gate(7.0)
    first = submit(pool, row(7.0))
    await until(lambda: first.taken, "the worker took the first request")
    batch = [submit(pool, row(v)) for v in (1.0, 13.0, 2.0)]  # queued: they run as one batch
    gate.set()
    assert doubled(await answer(first), 7.0)
    assert doubled(await answer(batch[0]), 1.0) and doubled(await answer(batch[2]), 2.0)
    with pytest.raises(InvalidInput) as info:
        await answer(batch[1])
    assert (info.value.status, info.value.message) == (400, "13 is not a valid input")


async def test_a_handler_exception_reaches_the_client_as_its_class_name_only(
    thread_pool: PoolFactory, caplog: pytest.LogCaptureFixture
) -> None:
    pool = thread_pool(Factory())
    await asyncio.to_thread(pool.scale, 1)
    request = row(-1.0)
    with caplog.at_level(logging.ERROR), pytest.raises(InferenceFailed) as info:
        await answer(submit(pool, request))
    assert info.value.status == 500
    assert info.value.message == (
        f"the handler failed: ValueError (request id {request.request_id}); see the server log"
    )
    (record,) = [r for r in caplog.records if "the handler raised" in r.getMessage()]
    assert f"model=tiny version=1.0 request_ids={request.request_id}" in record.getMessage()
    assert record.exc_info is not None and SECRET in str(record.exc_info[1])
    assert doubled(await answer(submit(pool, row(3.0))), 3.0)  # the worker keeps serving


# -- stuck workers -------------------------------------------------------------------------------
async def test_a_stuck_worker_whose_replacement_cannot_start_leaves_its_place_missing(
    thread_pool: PoolFactory, caplog: pytest.LogCaptureFixture
) -> None:
    factory = Factory(cls=OwnDoubler, fail_after=2)  # the two first workers load, no third
    pool = thread_pool(factory, max_batch_size=1, response_timeout_s=0.2)
    await asyncio.to_thread(pool.scale, 2)
    gate = factory.gate(7.0)
    stuck = submit(pool, row(7.0))
    await until(lambda: stuck.taken, "a worker took the request that hangs")

    # The watchdog abandons it; its replacement fails to load; the place stays missing.
    await until(lambda: pool.live == 1, "the stuck worker given up")
    await until(lambda: "could not start a worker in place of" in caplog.text, "a failed start")
    assert (pool.size, pool.live) == (2, 1)
    assert pool.counts() == {"READY": 1, "BUSY": 0, "RESTARTING": 1}
    assert doubled(await answer(submit(pool, row(1.0))), 1.0)  # the other worker serves

    # Once a handler can be built again, the watchdog's next try fills the place.
    factory.fail_after = None
    await until(lambda: pool.live == 2, "the place filled")
    assert pool.size == 2 and len(factory.built) == 3
    gate.set()
    await until(lambda: "its result was dropped" in caplog.text, "the abandoned call returned")
    assert doubled(await answer(submit(pool, row(2.0))), 2.0)


async def test_more_stuck_threads_than_allowed_fail_the_model(thread_pool: PoolFactory) -> None:
    factory = Factory()
    pool = thread_pool(factory, max_batch_size=1, response_timeout_s=0.2, max_abandoned=0)
    await asyncio.to_thread(pool.scale, 1)
    factory.gate(7.0)
    stuck = submit(pool, row(7.0))
    await until(lambda: stuck.taken, "the worker took the request that hangs")
    queued = submit(pool, row(1.0))
    with pytest.raises(ModelNotReady) as info:
        await answer(queued)
    reason = "1 worker threads are stuck in the handler past the response timeout of 0.2 s"
    assert info.value.message == f"model 'tiny' failed: {reason}"
    assert pool.failed_reason == reason


# -- one handler, several threads ------------------------------------------------------------------
class ContextKeeper(BaseHandler):
    """Records, from inside a batch, the context it holds; two batches wait for each other at a
    barrier, so that two threads are inside `handle` at once."""

    thread_safe = True

    def __init__(self) -> None:
        super().__init__()
        self.barrier = threading.Barrier(2, timeout=ANSWER_S)
        self.seen: list[tuple[str, Context | None]] = []

    def initialize(self, context: Context) -> None:
        self.context = context

    def inference(self, batch: Any) -> Any:
        self.barrier.wait()
        self.seen.append((threading.current_thread().name, self.context))
        return batch

    def postprocess(self, outputs: Any) -> list[InferenceResponse]:
        return [InferenceResponse(outputs=dict(r.inputs)) for r in outputs]


async def test_two_worker_threads_share_one_handler_and_its_context(
    thread_pool: PoolFactory,
) -> None:
    built: list[ContextKeeper] = []

    def factory(device: str) -> tuple[BaseHandler, Context]:
        handler = ContextKeeper()
        handler.initialize(context(device=device))
        built.append(handler)
        assert handler.context is not None
        return handler, handler.context

    pool = thread_pool(factory, max_batch_size=1)  # type: ignore[arg-type]
    await asyncio.to_thread(pool.scale, 2)
    (handler,) = built
    initialized = handler.context
    assert [slot.handler for slot in pool.slots()] == [handler, handler]
    jobs = [submit(pool, row(1.0)), submit(pool, row(2.0))]
    for job in jobs:
        await answer(job)
    assert len({thread for thread, _ in handler.seen}) == 2  # both workers ran it, at once
    assert all(seen is initialized for _, seen in handler.seen)
    assert handler.context is initialized


def test_handle_never_replaces_the_context_initialize_set() -> None:
    """Two threads call `handle` of one instance at once, each with a context of its own: the
    handler's own context stays the one `initialize` set."""
    handler = ContextKeeper()
    initialized = context()
    handler.initialize(initialized)
    others = [context(name="first"), context(name="second")]
    threads = [
        threading.Thread(target=handler.handle, args=([row(1.0)], other)) for other in others
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(ANSWER_S)
    assert len(handler.seen) == 2
    assert all(seen is initialized for _, seen in handler.seen)
    assert handler.context is initialized
