"""OpenTelemetry tracing: one trace per request, exported over OTLP. Off unless `tracing` is set.

Each HTTP request and gRPC call is a SERVER span named as OpenTelemetry's semantic conventions
say (`POST /predictions/{model_name}`, `inference.GRPCInferenceService/ModelInfer`), the child
of the client's W3C `traceparent` when it sends one, and the answer returns its own
`traceparent` (an HTTP header; gRPC initial metadata). Under it, for each model request it
queued:

    decode      from the request's arrival to its queueing (reading, decoding, checking it)
    queue       waiting for a worker (and for the batch to fill, with max_batch_delay)
    batch       the worker's run of the batch it was in: `scriptserve.batch.size`, the batch's
                request ids, and a link to every other request's span
      preprocess, inference, postprocess    the handler's stages, where it has them
    encode      from the answer to the response (writing the wire format)

The transports open a `RequestTrace` per request (`opened`) and the data plane fills in what it
decides (`note_model`, `note_queued`, `note_answered`) on the trace it finds through a context
variable (`current`), as the access log does. The worker pool leaves a `BatchRecord` on each
job it runs. Every child span is made when the request ends, from the times recorded on the
way: the event loop and the workers do no tracing work while the request runs, and nothing at
all when tracing is off or the request is not sampled.

Settings (`tracing_*`) choose the endpoint, the protocol (`grpc` or `http/protobuf`), the
sampling ratio and the service name; what they leave unset comes from OpenTelemetry's standard
environment variables (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`,
`OTEL_TRACES_SAMPLER` and `_ARG`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, headers,
certificates, timeouts). The OpenTelemetry SDK and exporters are the `tracing` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanContext, SpanKind, Tracer

    from scriptserve.server.workers.batching import BatchRecord, Job

log = logging.getLogger("scriptserve.tracing")

OtlpProtocol = Literal["grpc", "http/protobuf"]
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# gRPC codes a server span records as an error (OpenTelemetry's gRPC conventions).
MAX_TRACED_JOBS = 64
"""Model requests one trace records (a gRPC stream may carry thousands): the rest are counted."""
GRPC_SERVER_ERRORS = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the OpenTelemetry SDK is not installed."""


def _epoch_ns(monotonic_s: float, offset_s: float) -> int:
    return int((monotonic_s + offset_s) * 1e9)


@dataclass(eq=False)
class RequestTrace:
    """One request's server span and the times its children are made from."""

    span: Span
    started: float
    """time.monotonic() when the request arrived."""
    jobs: list[Job] = field(default_factory=list)
    """What the data plane queued for this request, in order (several for KServe v1), up to
    MAX_TRACED_JOBS."""
    job_models: list[tuple[str, str]] = field(default_factory=list)
    """The model and version each of `jobs` was queued for (a pipeline's steps differ)."""
    queued: int = 0
    """How many model requests it queued."""
    answered: float = 0.0
    """time.monotonic() when the data plane answered; 0 when it did not (errors, streams)."""
    recording: bool = field(init=False)
    """Whether the span is sampled: only then are its children made."""
    pinned: bool = False
    """Its model is set for good (a pipeline's): the steps' models do not replace it."""

    def __post_init__(self) -> None:
        self.recording = self.span.is_recording()

    @property
    def context(self) -> SpanContext:
        return self.span.get_span_context()

    def note_model(self, name: str, version: str | None, pin: bool = False) -> None:
        """The data plane resolved the request's model (and version, once known); `pin` sets it
        for good (a pipeline's request: its span names the pipeline, whatever its steps note;
        the steps' jobs become its children all the same)."""
        if self.pinned:
            return
        self.pinned = pin
        if self.recording:
            self.span.set_attribute("scriptserve.model.name", name)
            if version is not None:
                self.span.set_attribute("scriptserve.model.version", version)

    def note_queued(self, job: Job, model: str, version: str) -> None:
        """The data plane queued `job` for this request, for `model` `version`: its batch will
        link to this span. A request that is not sampled leaves its jobs alone, so its batch
        records nothing."""
        if self.recording:
            self.queued += 1
            if len(self.jobs) < MAX_TRACED_JOBS:
                self.jobs.append(job)
                self.job_models.append((model, version))
                job.span_context = self.context

    def note_answered(self, _future: object = None) -> None:
        """The data plane has the answer; what follows is encoding it."""
        if not self.answered:
            self.answered = time.monotonic()

    def answered_when(self, future: asyncio.Future[Any]) -> None:
        """The answer is `future`'s outcome (a stream's end, or a request answered by
        callback)."""
        if self.recording:
            future.add_done_callback(self.note_answered)


_current: ContextVar[RequestTrace | None] = ContextVar("scriptserve_trace", default=None)


@contextlib.contextmanager
def opened(trace: RequestTrace | None) -> Iterator[RequestTrace | None]:
    """Make `trace` the one the data plane fills in while the request runs in this context."""
    if trace is None:
        yield None
        return
    token = _current.set(trace)
    try:
        yield trace
    finally:
        _current.reset(token)


def enter(trace: RequestTrace | None) -> Token[RequestTrace | None] | None:
    """Make `trace` the one the data plane fills in, until `leave` is given what this returns
    (a callback's work: what it starts, a task or a callback, keeps it)."""
    return None if trace is None else _current.set(trace)


def leave(token: Token[RequestTrace | None] | None) -> None:
    if token is not None:
        _current.reset(token)


def current() -> RequestTrace | None:
    """The trace of the request running in this context, if tracing is on."""
    return _current.get()


class Tracing:
    """The tracer provider and its OTLP exporter; `enabled` False traces nothing."""

    def __init__(
        self,
        enabled: bool = False,
        *,
        endpoint: str | None = None,
        protocol: OtlpProtocol | None = None,
        sampling_ratio: float | None = None,
        service_name: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.enabled = enabled
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        self._offset_s = time.time() - time.monotonic()
        self._root_ratio: float | None = None
        if not enabled:
            return
        env = os.environ if environ is None else environ
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
            from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise TracingUnavailable(
                f"tracing needs the OpenTelemetry SDK ({exc.name} is missing): "
                "pip install 'scriptserve[tracing]'"
            ) from None
        from scriptserve import __version__

        attributes: dict[str, str] = {"service.version": __version__}
        if service_name is not None:
            attributes["service.name"] = service_name
        elif "OTEL_SERVICE_NAME" not in env and "service.name=" not in env.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            attributes["service.name"] = "scriptserve"
        sampler = None  # the SDK's: OTEL_TRACES_SAMPLER, else parent-based always-on
        if sampling_ratio is not None:
            # A request without a client's traceparent (a root) is sampled here, before the
            # SDK is called (`unsampled_root`): a root left out costs two random numbers, not
            # a span. The SDK keeps every root it is handed and follows a client's parent.
            self._root_ratio = sampling_ratio
            sampler = ParentBased(ALWAYS_ON)
        self._provider = TracerProvider(sampler=sampler, resource=Resource.create(attributes))
        self.protocol = protocol or _protocol_from(env)
        self.exporter = _exporter(self.protocol, endpoint)
        self._provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self._tracer = self._provider.get_tracer("scriptserve", __version__)
        self._kind: type[SpanKind] = SpanKind
        self._propagator = TraceContextTextMapPropagator()
        self._left_out = (NonRecordingSpan, SpanContext, TraceFlags(TraceFlags.DEFAULT))
        sampling = (
            f"roots sampled at {sampling_ratio:g}, a client's parent followed"
            if sampling_ratio is not None
            else self._provider.sampler.get_description()
        )
        log.info(
            "tracing on: OTLP %s to %s, sampler %s",
            self.protocol,
            getattr(self.exporter, "_endpoint", endpoint or "the default endpoint"),
            sampling,
        )

    @property
    def samples_roots(self) -> bool:
        """Requests without a client's trace context are sampled at a ratio of the server's
        (`left_out_root`), not by the SDK's sampler."""
        return self._root_ratio is not None

    # -- a request's server span -------------------------------------------------------------
    def start(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]
    ) -> RequestTrace:
        """The server span of a request that arrived now, the child of the client's
        `traceparent` when `headers` carry a valid one."""
        assert self._tracer is not None
        parent = self._propagator.extract(headers) if TRACEPARENT in headers else None
        started = time.monotonic()
        span = self._tracer.start_span(
            name,
            context=parent,
            kind=self._kind.SERVER,
            attributes=attributes,
            start_time=_epoch_ns(started, self._offset_s),
        )
        return RequestTrace(span, started)

    def unsampled_root(self) -> RequestTrace | None:
        """For a request without a `traceparent`: a trace that records nothing when the sampling
        ratio leaves it out (made without the SDK), else None (open it with `start`). Always
        None when the sampler is the SDK's own (OTEL_TRACES_SAMPLER)."""
        ids = self.left_out_root()
        if ids is None:
            return None
        span, context, flags = self._left_out
        return RequestTrace(span(context(*ids, False, flags)), 0.0)

    def left_out_root(self) -> tuple[int, int] | None:
        """For a request without a `traceparent`: the trace and span ids of a trace the sampling
        ratio leaves out (nothing records it: only its `traceparent`, `left_out_traceparent`,
        goes back), else None (open it with `start`)."""
        ratio = self._root_ratio
        if ratio is None or random.random() < ratio:
            return None
        return random.getrandbits(128) or 1, random.getrandbits(64) or 1

    def traceparent(self, trace: RequestTrace) -> str:
        """The W3C traceparent of the request's span, returned to the client."""
        context = trace.context
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"

    def end(
        self, trace: RequestTrace, attributes: Mapping[str, Any], error: str | None = None
    ) -> None:
        """End the request's span with its last attributes (and an error description when it
        failed on the server's side), after making its children from the recorded times."""
        from opentelemetry.trace import Status, StatusCode

        span = trace.span
        ended = time.monotonic()
        if trace.recording:
            self._children(trace, ended)
            span.set_attributes(attributes)
            if trace.queued > 1:
                span.set_attribute("scriptserve.requests", trace.queued)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_epoch_ns(ended, self._offset_s))

    # -- children, from the recorded times ---------------------------------------------------
    def _children(self, trace: RequestTrace, ended: float) -> None:
        from opentelemetry import trace as otel

        parent = otel.set_span_in_context(trace.span)
        first = trace.jobs[0].enqueued if trace.jobs else trace.answered or ended
        self._span("decode", parent, trace.started, first)
        for job, (model, version) in zip(trace.jobs, trace.job_models, strict=True):
            attributes = {
                "scriptserve.request.id": job.request.request_id,
                "scriptserve.model.name": model,
                "scriptserve.model.version": version,
            }
            taken = job.dequeued or (job.batch.started if job.batch else 0.0)
            if not taken:
                continue  # never taken by a worker (cancelled, timed out in the queue)
            self._span("queue", parent, job.enqueued, taken, attributes)
            if job.batch is not None:
                self._batch(job, job.batch, parent, attributes)
        if trace.answered:
            self._span("encode", parent, trace.answered, max(ended, trace.answered))

    def _batch(self, job: Job, batch: BatchRecord, parent: Any, about: Mapping[str, Any]) -> None:
        from opentelemetry import trace as otel
        from opentelemetry.trace import Link

        links = [
            Link(other.span_context, {"scriptserve.request.id": other.request.request_id})
            for other in batch.jobs
            if other is not job and other.span_context is not None
        ]
        attributes = {
            **about,  # the request id, the model and version that ran it
            "scriptserve.batch.size": len(batch.jobs),
            "scriptserve.batch.request_ids": [other.request.request_id for other in batch.jobs],
            "scriptserve.worker.id": batch.worker,
        }
        span = self._span("batch", parent, batch.started, batch.ended, attributes, links, end=False)
        inner = otel.set_span_in_context(span)
        if batch.input_s or batch.output_s:
            model_from = batch.started + batch.input_s
            model_to = max(model_from, batch.ended - batch.output_s)
            self._span("preprocess", inner, batch.started, model_from)
            self._span("inference", inner, model_from, model_to)
            self._span("postprocess", inner, model_to, batch.ended)
        else:
            self._span("inference", inner, batch.started, batch.ended)
        span.end(end_time=_epoch_ns(batch.ended, self._offset_s))

    def _span(
        self,
        name: str,
        parent: Any,
        start: float,
        end_at: float,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Any] = (),
        end: bool = True,
    ) -> Span:
        assert self._tracer is not None
        span = self._tracer.start_span(
            name,
            context=parent,
            attributes=attributes,
            links=links,
            start_time=_epoch_ns(start, self._offset_s),
        )
        if end:
            span.end(end_time=_epoch_ns(max(end_at, start), self._offset_s))
        return span

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is left and stop the exporter."""
        if self._provider is not None:
            self._provider.force_flush(int(timeout_s * 1e3))
            self._provider.shutdown()
            self._provider = None


def _protocol_from(env: Mapping[str, str]) -> OtlpProtocol:
    value = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if value not in ("grpc", "http/protobuf"):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={value!r} is not supported; use grpc or http/protobuf"
        )
    return value  # type: ignore[return-value]


def _exporter(protocol: OtlpProtocol, endpoint: str | None) -> Any:
    """The OTLP span exporter; `endpoint` None leaves it to the OTEL_* variables (and then to
    the protocol's default, localhost:4317 or :4318)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=endpoint)


def headers_of(pairs: Sequence[tuple[str, str]] | None) -> dict[str, str]:
    """The trace-context entries of gRPC metadata or decoded HTTP headers."""
    return {k: v for k, v in pairs or () if k in (TRACEPARENT, TRACESTATE)}


def error_for_http(status: int) -> str | None:
    """A server span is an error when the server failed (5xx), not when the client did."""
    return f"HTTP {status}" if status >= 500 else None


def error_for_grpc(code: str) -> str | None:
    return code if code in GRPC_SERVER_ERRORS else None


def left_out_traceparent(ids: tuple[int, int]) -> str:
    """The W3C traceparent of a root the sampling ratio left out (`Tracing.left_out_root`)."""
    return f"00-{ids[0]:032x}-{ids[1]:016x}-00"
