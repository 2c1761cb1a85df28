"""The inference data plane: what REST routes and gRPC methods translate to and from.

Every request decision is made here once, whatever the transport: which model version serves
a request (resolved once, and the answer names it), in which order a request is checked (the
model first, then what the client sent), whether the server and a model are ready, the
deadline (a client may shorten the server's, never lengthen it; a timer answers 504 on time
whatever the worker does), which outputs a tensor protocol answers with, and the metrics of
every outcome. A request either is answered with a `Served` or ends with a `ServingError`.

One entry per kind of answer, each a `Call` (admission, deadline, in-flight count, the access
log's and tracing's notes, metrics) around the request's job. A job's future is the request's
answer: the worker that ran it resolves it with the `Served` answer or the ServingError that
ends it, so a transport awaits it or adds its reply as a callback, and cancels it to withdraw:

    future = dataplane.submit("mnist", None, decode, protocol="rest")  # one answer
    future = dataplane.submit("mnist", None, wire.decode, protocol="rest", encode=wire.keep)
    served = await dataplane.submit("mnist", None, decode, protocol="grpc")  # the same, awaited
    stream = dataplane.stream("mnist", None, request, protocol="rest")  # in parts
    answers = await dataplane.infer_many("mnist", None, decode, protocol="rest")  # KServe v1
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.errors import (
    DeadlineExceeded,
    InvalidInput,
    MethodNotAllowed,
    ModelNotFound,
    ModelNotReady,
    ServingError,
    error_for_status,
)
from scriptserve.server.inference.deadlines import Deadlines, Entry
from scriptserve.server.inference.decoding import Admitted, Encode, Request, Served, decode_checked
from scriptserve.server.inference.inflight import InFlight
from scriptserve.server.inference.pipeline_run import run_pipeline
from scriptserve.server.models.description import Descriptions
from scriptserve.server.models.pipelines import VERSION as PIPELINE_VERSION
from scriptserve.server.models.pipelines import Pipeline
from scriptserve.server.models.registry import ModelRegistry, ModelState, ModelVersion
from scriptserve.server.observability import access_log, tracing
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.settings import ServerSettings
from scriptserve.server.workers.batching import Job
from scriptserve.server.workers.streaming import PartStream, StreamRefused

log = logging.getLogger("scriptserve.dataplane")

UNKNOWN_LABEL = "_unknown"
"""Metric label of a model or version the registry does not hold (no model name starts with _)."""
CLIENT_CLOSED = 499
"""Metric status of a request whose client went away first (nginx's "client closed request")."""
InParts = Callable[[Job, ModelVersion, Admitted], None]
"""What makes a queued job's answer come in parts (`DataPlane._in_parts`)."""
DEADLINE_SLACK_S = 0.05
"""How near its deadline a call counts as expired: the client's timer and the server's differ by
the network's latency, so a client's cancel may arrive just before the server's deadline."""


class Call:
    """One request in the data plane, from its admission to its last metric: what serves it (a
    model version, whose job and deadline it holds, or a pipeline, whose steps run as a task),
    its place in the in-flight count, and the one callback of its future (`end`) that drops
    the deadline, leaves the count and counts the outcome."""

    __slots__ = (
        "deadline",
        "job",
        "labels",
        "mv",
        "name",
        "plane",
        "protocol",
        "record",
        "started",
        "timeout_s",
        "trace",
    )

    def __init__(self, plane: DataPlane, name: str, protocol: str, timeout_s: float | None) -> None:
        self.plane = plane
        self.name = name
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.started = time.perf_counter()
        self.labels: tuple[str, str] | None = None
        """Once known: the name and version it is counted under (its metric labels)."""
        self.mv: ModelVersion | None = None
        """Once resolved: the model version that serves it; None for a pipeline's request."""
        self.record = access_log.current()
        """Its access line, while the access log is on."""
        self.trace = tracing.current()
        """Its span, while tracing is on."""

    def admit(
        self,
        version: str | None,
        request: Request,
        encode: Encode | None = None,
        in_parts: InParts | None = None,
    ) -> Job:
        """Resolve the model version and queue the request with its deadline (its answer
        written by `encode` on the worker's thread when given; taken in parts through what
        `in_parts` attaches, for a stream); counted in flight until its future is done. A
        refusal raises the ServingError that answers it, counted."""
        plane = self.plane
        try:
            mv = self.mv = self.resolve(version, streaming=in_parts is not None)
            self.labels = (mv.name, mv.version)
            self.job, self.deadline = self.queue(mv, request, encode, in_parts)
        except ServingError as exc:
            self.note(version)
            self.count(exc.status)
            raise
        self.note(version, (self.job,))
        plane._inflight.arrive(*self.labels)
        self.job.future.add_done_callback(self.end)
        return self.job

    def run_pipeline(
        self, pipeline: Pipeline, version: str | None, request: Request, encode: Encode | None
    ) -> asyncio.Future[Served]:
        """A pipeline's request: its steps run as a task (pipeline_run.py), whose end is the
        request's (its answer written by `encode` there, when given); counted in flight and in
        the metrics under the pipeline's name. A refusal raises the ServingError that answers
        it, counted."""
        plane = self.plane
        self.labels = (pipeline.name, PIPELINE_VERSION)
        try:
            if version not in (None, PIPELINE_VERSION):
                raise ModelNotFound(
                    f"pipeline {pipeline.name!r} has no version {version!r} (versions: "
                    f"{PIPELINE_VERSION})"
                )
            self.note(PIPELINE_VERSION, pin=True)
            if plane.refusing:
                raise ModelNotReady("the server is shutting down; retry on another replica")
            given = request if isinstance(request, InferenceRequest) else _decoded(request)
        except ServingError as exc:
            self.count(exc.status)
            raise
        run = run_pipeline(plane.submit, pipeline, given, self.timeout_s, self.protocol, encode)
        task = asyncio.ensure_future(run)
        plane._inflight.arrive(*self.labels)
        task.add_done_callback(self.end)
        return task

    def resolve(self, version: str | None, streaming: bool = False) -> ModelVersion:
        """The model version that serves the request; 404 when unknown, 503 when the server
        refuses new requests or the version cannot serve."""
        plane, name = self.plane, self.name
        if plane.refusing:
            raise ModelNotReady("the server is shutting down; retry on another replica")
        mv = plane.registry.get(name, version)
        if mv.state is ModelState.FAILED:
            raise ModelNotReady(f"model {name!r} failed: {mv.reason}")
        residency = mv.residency
        residency.last_used = time.monotonic()
        if residency.parked:
            # Not loaded (lazy, or unloaded to make room): the request waits in its queue for
            # the load its first request starts, bounded by its deadline.
            plane.registry.memory.wanted(mv)
        elif mv.pool.size == 0:
            raise ModelNotReady(
                f"model {name!r} version {mv.version} is scaled to 0 workers; scale it up "
                "(PUT /models/NAME?min_worker=1) or use another version"
            )
        elif not mv.accepting:
            raise ModelNotReady(f"model {name!r} has no ready worker; retry later")
        if mv.streams and not streaming:
            raise StreamRefused(name)
        return mv

    def queue(
        self,
        mv: ModelVersion,
        request: Request,
        encode: Encode | None = None,
        in_parts: InParts | None = None,
    ) -> tuple[Job, Entry]:
        """Queue the request with its deadline, kept by the data plane's `Deadlines`, which
        answers 504 at it (a stream's job gets what takes its parts from `in_parts` first). A
        request given as the function that decodes it is decoded by the worker that takes it,
        and every request is checked there (`decoding.Admitted`)."""
        budget = mv.settings.response_timeout_s
        if self.timeout_s is not None:
            if self.timeout_s <= 0:
                raise DeadlineExceeded("the request's deadline passed before it was queued")
            budget = min(budget, self.timeout_s)  # a client may shorten it, never lengthen
        loop = asyncio.get_running_loop()
        admitted = Admitted(mv, request, self.record, encode)  # decoded and answered by its worker
        deadline = time.monotonic() + budget
        job = Job(InferenceRequest(), loop.create_future(), deadline, admitted, admitted.served)
        if in_parts is not None:
            in_parts(job, mv, admitted)  # before a worker can take it
        trace = self.trace
        if trace is not None and trace.recording:
            job.span_context = trace.context  # before a worker takes it: its batch links to it
        mv.batcher.put(job)
        return job, self.plane._deadlines.add(job, mv.batcher, budget)

    def note(self, asked: str | None, jobs: Sequence[Job] = (), pin: bool = False) -> None:
        """What the access line and the span say of the request, once it is queued or refused:
        the model version that serves it (what was `asked` for, when it was refused before one
        was resolved) and the jobs it queued; `pin` names it for good (a pipeline's request:
        its steps' models do not replace it)."""
        record, trace = self.record, self.trace
        if record is None and trace is None:
            return
        name, version = self.labels or (self.name, asked)
        if record is not None:
            record.note_model(name, version, pin)
        if trace is not None:
            trace.note_model(name, version, pin, jobs)

    def end(self, future: asyncio.Future[Served]) -> None:
        """The request's future is done: its answer, its error, or cancelled (the client went
        away or the deadline passed)."""
        labels = self.labels
        assert labels is not None
        mv = self.mv
        if mv is not None:
            self.plane._deadlines.remove(self.deadline)
            if future.cancelled():
                mv.batcher.cancel(self.job)  # the client went away: free its slot if queued
        self.plane._inflight.depart(*labels)
        trace = self.trace
        if trace is not None and trace.recording:
            trace.note_answered()
        if future.cancelled():
            status = cancelled_status(self.started, self.timeout_s)
        else:
            error = future.exception()
            status = 200 if error is None else getattr(error, "status", 500)
        self.count(status)

    def count(self, status: int) -> None:
        """The request's outcome in the metrics, under its model version once known."""
        labels = self.labels or self.plane._unknown(self.name)
        elapsed = time.perf_counter() - self.started
        self.plane.metrics.observe_request(*labels, self.protocol, status, elapsed)


class DataPlane:
    """Inference, health and descriptions of the served models (see the module docstring)."""

    def __init__(
        self, registry: ModelRegistry, metrics: ServerMetrics, settings: ServerSettings
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.settings = settings
        self.descriptions = Descriptions(registry, metrics)
        """What the server says about itself and its models (metadata, configuration,
        statistics)."""
        self.starting = True
        """Until the models named at startup have all been loaded (or have failed)."""
        self.draining = False
        """Shutting down: not ready, so balancers send new traffic elsewhere; what still arrives
        on open connections is served until `refusing`."""
        self.refusing = False
        """No new request is accepted (answered 503: retry on another replica)."""
        self._inflight = InFlight()
        self._deadlines = Deadlines()

    # -- health and metadata -----------------------------------------------------------------
    @property
    def inflight(self) -> int:
        """Requests accepted for inference and not yet answered, across every model."""
        return self._inflight.total

    def inflight_of(self, name: str, version: str) -> int:
        return self._inflight.of(name, version)

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Ready for traffic: started, not draining, and every model that should be loaded is
        ready (the registry only holds the startup models it has begun loading)."""
        return not self.starting and not self.draining and self.registry.healthy()

    def model_ready(self, name: str, version: str | None = None) -> bool:
        pipeline = self.registry.pipelines.get(name)
        if pipeline is not None:
            return not self.draining and all(
                self._ready_or_false(step.model, step.version) for step in pipeline.steps
            )
        return not self.draining and self.registry.get(name, version).ready

    def _ready_or_false(self, name: str, version: str | None) -> bool:
        try:
            return self.registry.get(name, version).ready
        except ServingError:
            return False

    # -- inference ---------------------------------------------------------------------------
    def submit(
        self,
        name: str,
        version: str | None,
        request: Request,
        *,
        protocol: str,
        timeout_s: float | None = None,
        encode: Encode | None = None,
    ) -> asyncio.Future[Served]:
        """Run one request, given as it is or as the function that decodes it (called once the
        model is known to serve; `encode`, when given, writes its tensor answer in the
        transport's format before the future ends, on the worker's thread). The future it
        returns ends with the answer or the ServingError that ends the request; cancelling it
        withdraws the request. Raises ServingError when the request cannot be queued."""
        call = Call(self, name, protocol, timeout_s)
        pipeline = self.registry.pipelines.get(name)
        if pipeline is not None:
            return call.run_pipeline(pipeline, version, request, encode)
        return call.admit(version, request, encode=encode).future

    def stream(
        self,
        name: str,
        version: str | None,
        request: Request,
        *,
        protocol: str,
        timeout_s: float | None = None,
    ) -> PartStream[Served]:
        """Run one request whose answer the client takes as it comes, part by part (an answer
        in one piece is a stream of one). Raises ServingError when it cannot be queued; the
        stream then raises what ended it early. The deadline covers the whole stream."""
        job = Call(self, name, protocol, timeout_s).admit(version, request, in_parts=self._in_parts)
        assert job.stream is not None
        return job.stream

    def _in_parts(self, job: Job, mv: ModelVersion, admitted: Admitted) -> None:
        """A stream's job: its PartStream makes each part's answer, in place of the job's one
        `finish`."""
        job.finish = None
        job.stream = PartStream(
            job.future,
            self.settings.stream_max_unread_parts,
            admitted.served,
            model=(mv.name, mv.version),
            streaming=mv.streams,
        )

    async def infer_many(
        self,
        name: str,
        version: str | None,
        decode: Callable[[], Sequence[InferenceRequest]],
        *,
        protocol: str,
        timeout_s: float | None = None,
        item: str = "item",
        explain: bool = False,
    ) -> list[Served]:
        """Several requests to one model version, resolved once (KServe v1's instances):
        decoded once the model is known to serve, queued together so that they batch, answered
        in order. The first failure answers the call, a 4xx one naming its `item` ("instance 2:
        ..."), and withdraws the others. `explain` asks the handler for explanations: a model
        whose handler has none answers 501. Raises ServingError."""
        call = Call(self, name, protocol, timeout_s)
        status = 500
        queued: list[tuple[Job, Entry]] = []
        noted = False
        try:
            mv = call.mv = call.resolve(version)
            call.labels = (mv.name, mv.version)
            if explain and not mv.explains:
                raise MethodNotAllowed(
                    f"model {name!r} has no explanations (its handler does not implement "
                    "them); ask for predictions instead",
                    status=501,
                )
            requests = decode_checked(mv, decode)
            if len(requests) > mv.settings.queue_size:
                raise InvalidInput(
                    f"{len(requests)} {item}s are more than model {name!r} queues "
                    f"({mv.settings.queue_size}); send at most that many per request"
                )
            for request in requests:
                queued.append(call.queue(mv, request))
            call.note(version, [job for job, _ in queued])
            noted = True
            self._inflight.arrive(*call.labels)
            try:
                futures = [job.future for job, _ in queued]
                await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                self._inflight.depart(*call.labels)
                if call.trace is not None:
                    call.trace.note_answered()
            for i, future in enumerate(futures):
                error = future.exception() if future.done() else None
                if isinstance(error, ServingError) and 400 <= error.status < 500:
                    raise error_for_status(error.status, f"{item} {i}: {error.message}")
                if error is not None:
                    raise error
            status = 200
            return [job.future.result() for job, _ in queued]
        except ServingError as exc:
            status = exc.status
            if not noted:
                call.note(version)
            raise
        except asyncio.CancelledError:
            status = cancelled_status(call.started, timeout_s)
            raise
        finally:
            for job, deadline in queued:
                self._deadlines.remove(deadline)
                if not job.future.done() and call.mv is not None:
                    call.mv.batcher.cancel(job)  # withdrawn: free the slot, leave the worker be
                    job.future.cancel()
            call.count(status)

    def _unknown(self, name: str) -> tuple[str, str]:
        # Clients choose these names: a typo must not mint a new time series.
        return (name if name in self.registry.names() else UNKNOWN_LABEL), UNKNOWN_LABEL

    # -- shutdown ----------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the accepted ones; True if all were answered."""
        self.draining = self.refusing = True
        return await self._inflight.wait_idle(timeout_s)

    async def close(self) -> None:
        """Stop taking traffic, let queues drain, stop every model."""
        self.draining = self.refusing = True
        await self.registry.close(self.settings.drain_timeout_s)


def _decoded(decode: Callable[[], InferenceRequest]) -> InferenceRequest:
    """A pipeline's request decoded on the loop (its steps take tensors, not the wire):
    whatever cannot be decoded is the client's error."""
    try:
        return decode()
    except ServingError:
        raise
    except Exception as exc:
        raise InvalidInput(f"the request could not be decoded ({type(exc).__name__})") from None


def cancelled_status(started: float, timeout_s: float | None) -> int:
    """The status of a call that was cancelled: its client went away (499), or its own
    deadline ended it first (504); neither is a server error."""
    elapsed = time.perf_counter() - started
    expired = timeout_s is not None and elapsed >= timeout_s - DEADLINE_SLACK_S
    return DeadlineExceeded.status if expired else CLIENT_CLOSED
