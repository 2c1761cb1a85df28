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
decides (`note_model`, `note_answered`) on the trace it finds through a context
variable (`current`), as the access log does. The worker pool leaves a `BatchRecord` on each
job it runs. When a sampled request ends, its span and children are made from the times
recorded on the way, as plain data (`span_export.SpanRecord`), and queued for the exporter
process (`span_export.py`), which makes the OpenTelemetry spans and sends them: the event loop
and the workers do no tracing work while the request runs, the loop only builds that record at
its end, and nothing at all is done when tracing is off or the request is not sampled. Sampling
and the server span's ids are decided here, so the answer carries its `traceparent` at once.

Settings (`tracing_*`) choose the endpoint, the protocol (`grpc` or `http/protobuf`), the
sampling ratio and the service name; what they leave unset comes from OpenTelemetry's standard
environment variables (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`,
`OTEL_TRACES_SAMPLER` and `_ARG`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, headers,
certificates, timeouts). The OpenTelemetry SDK and exporters are the `tracing` extra.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal

from scriptserve.server.observability.span_export import Child, SpanExport

if TYPE_CHECKING:
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


class RequestTrace:
    """One request's server span, as plain data, and the times its children are made from."""

    __slots__ = (
        "answered",
        "attributes",
        "flags",
        "job_models",
        "jobs",
        "name",
        "parent_id",
        "pinned",
        "queued",
        "recording",
        "span_id",
        "started",
        "trace_id",
        "trace_state",
    )

    def __init__(
        self,
        trace_id: int,
        span_id: int,
        flags: int,
        name: str = "",
        attributes: dict[str, Any] | None = None,
        started: float = 0.0,
        parent_id: int = 0,
        trace_state: str = "",
    ) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.flags = flags
        """W3C trace flags: 01 when it is sampled."""
        self.recording = bool(flags & 1)
        """Whether the span is sampled: only then are its children made and it is exported."""
        self.name = name
        self.attributes = {} if attributes is None else attributes
        self.started = started
        """time.monotonic() when the request arrived."""
        self.parent_id = parent_id
        """The client's span id, 0 for a root."""
        self.trace_state = trace_state
        """The client's W3C tracestate, passed on."""
        self.jobs: list[Job] = []
        """What the data plane queued for this request, in order (several for KServe v1), up
        to MAX_TRACED_JOBS."""
        self.job_models: list[tuple[str, str]] = []
        """The model and version each of `jobs` was queued for (a pipeline's steps differ)."""
        self.queued = 0
        """How many model requests it queued."""
        self.answered = 0.0
        """time.monotonic() when the data plane answered; 0 when it did not (errors, streams)."""
        self.pinned = False
        """Its model is set for good (a pipeline's): the steps' models do not replace it."""

    @property
    def context(self) -> tuple[int, int, int]:
        """(trace id, span id, flags): what a batch's span links to."""
        return self.trace_id, self.span_id, self.flags

    def note_model(
        self, name: str, version: str | None, pin: bool = False, jobs: Sequence[Job] = ()
    ) -> None:
        """The data plane resolved the request's model (and version, once known) and queued
        `jobs` for it, whose batches link to this span (the data plane set their
        `span_context`); `pin` sets the model for good (a pipeline's request: its span names
        the pipeline, whatever its steps note; the steps' jobs become its children all the
        same). A request that is not sampled records nothing."""
        if not self.recording:
            self.pinned = self.pinned or pin
            return
        for job in jobs:
            self.queued += 1
            if len(self.jobs) < MAX_TRACED_JOBS:
                self.jobs.append(job)
                self.job_models.append((name, version or ""))
        if self.pinned:
            return
        self.pinned = pin
        self.attributes["scriptserve.model.name"] = name
        if version is not None:
            self.attributes["scriptserve.model.version"] = version

    def note_answered(self, _future: object = None) -> None:
        """The data plane has the answer; what follows is encoding it."""
        if not self.answered:
            self.answered = time.monotonic()


CURRENT: ContextVar[RequestTrace | None] = ContextVar("scriptserve_trace", default=None)
"""The trace the data plane fills in for the request running in this context: set by
`opened`, or in the context an HTTP request runs in (server/rest/observe.py)."""


@contextlib.contextmanager
def opened(trace: RequestTrace | None) -> Iterator[RequestTrace | None]:
    """Make `trace` the one the data plane fills in while the request runs in this context."""
    if trace is None:
        yield None
        return
    token = CURRENT.set(trace)
    try:
        yield trace
    finally:
        CURRENT.reset(token)


def current() -> RequestTrace | None:
    """The trace of the request running in this context, if tracing is on."""
    return CURRENT.get()


class Tracing:
    """Sampling, the server spans' ids and their export (`span_export.py`); `enabled` False
    traces nothing."""

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
        self._export: SpanExport | None = None
        self._offset_s = time.time() - time.monotonic()
        self._root_ratio: float | None = None
        self.roots_left_out = 0
        """Roots the sampling ratio leaves out before it keeps the next one: the ratio's draws
        made in advance, one geometric draw of the gap (`_gap`) in place of one draw a root,
        which is the same process (each root is kept at the ratio, independently of the
        others). Counted down by `leaves_out_root`, and by the HTTP protocol itself for a
        request nothing else would see (server/rest/protocol_cycle.py): on the event loop's
        thread, where every request starts. 0 when there is no ratio of the server's."""
        if not enabled:
            return
        env = os.environ if environ is None else environ
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
            from opentelemetry.trace import SpanKind, get_current_span
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise TracingUnavailable(
                f"tracing needs the OpenTelemetry SDK ({exc.name} is missing): "
                "pip install 'scriptserve[tracing]'"
            ) from None
        from scriptserve import __version__

        resource: dict[str, str] = {"service.version": __version__}
        if service_name is not None:
            resource["service.name"] = service_name
        elif "OTEL_SERVICE_NAME" not in env and "service.name=" not in env.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        ):
            resource["service.name"] = "scriptserve"
        if sampling_ratio is not None:
            # A request without a client's traceparent (a root) is sampled here
            # (`leaves_out_root`): a root left out costs a count down. A client's parent is
            # followed.
            self._root_ratio = sampling_ratio
            self.roots_left_out = self._gap()
            self._sampler: Any = ParentBased(ALWAYS_ON)
        else:  # the SDK's, from OTEL_TRACES_SAMPLER (parent-based always-on when unset)
            self._sampler = TracerProvider(shutdown_on_exit=False).sampler
        self._server_kind = SpanKind.SERVER
        self._span_in = get_current_span
        self._propagator = TraceContextTextMapPropagator()
        self.protocol = protocol or _protocol_from(env)
        exporter = f"opentelemetry.exporter.otlp.proto.{self.protocol.split('/')[0]}"
        if not _importable(exporter):
            raise TracingUnavailable(
                f"tracing over OTLP {self.protocol} needs {exporter}: "
                "pip install 'scriptserve[tracing]'"
            )
        self._export = SpanExport(self.protocol, endpoint, resource, environ)
        sampling = (
            f"roots sampled at {sampling_ratio:g}, a client's parent followed"
            if sampling_ratio is not None
            else self._sampler.get_description()
        )
        log.info(
            "tracing on: OTLP %s to %s, sampler %s",
            self.protocol,
            endpoint or "the endpoint of the OTEL_* variables",
            sampling,
        )

    @property
    def samples_roots(self) -> bool:
        """Requests without a client's trace context are sampled at a ratio of the server's
        (`leaves_out_root`), not by the SDK's sampler."""
        return self._root_ratio is not None

    # -- a request's server span -------------------------------------------------------------
    def start(
        self, name: str, headers: Mapping[str, str], attributes: dict[str, Any]
    ) -> RequestTrace:
        """The server span of a request that arrived now, the child of the client's
        `traceparent` when `headers` carry a valid one; it keeps `attributes`."""
        started = time.monotonic()
        span_id = random.getrandbits(64) or 1
        if TRACEPARENT in headers:
            parent = self._propagator.extract(headers)
            client = self._span_in(parent).get_span_context()
            if client.is_valid:
                result = self._sampler.should_sample(
                    parent, client.trace_id, name, self._server_kind, attributes
                )
                if result.attributes:
                    attributes.update(result.attributes)
                state = result.trace_state
                return RequestTrace(
                    client.trace_id,
                    span_id,
                    1 if result.decision.is_sampled() else 0,
                    name,
                    attributes,
                    started,
                    client.span_id,
                    state.to_header() if state else "",
                )
        trace_id = random.getrandbits(128) or 1
        if self._root_ratio is None:
            result = self._sampler.should_sample(
                None, trace_id, name, self._server_kind, attributes
            )
            if not result.decision.is_sampled():
                return RequestTrace(trace_id, span_id, 0)
            if result.attributes:
                attributes.update(result.attributes)
        return RequestTrace(trace_id, span_id, 1, name, attributes, started)

    def leaves_out_root(self) -> bool:
        """The sampling ratio's decision for a request without a `traceparent`: True when the
        ratio is the server's and leaves it out (`roots_left_out`). Nothing is made of such a
        request (no span, no ids, no `traceparent` in its answer: nothing would record the
        trace it named); open every other with `start`. Always False when the sampler is the
        SDK's own (OTEL_TRACES_SAMPLER)."""
        if self.roots_left_out:
            self.roots_left_out -= 1
            return True
        if self._root_ratio is not None:
            self.roots_left_out = self._gap()  # this one is kept: the gap to the next
        return False

    def _gap(self) -> int:
        """How many roots the ratio leaves out before the next one it keeps: the number of
        failures before the first success of draws that succeed at the ratio (geometric), by
        inversion of one uniform draw; at ratio 0 no root is ever kept."""
        ratio = self._root_ratio
        if ratio is None or ratio >= 1:
            return 0
        if ratio <= 0:
            return sys.maxsize
        return int(math.log(1.0 - random.random()) / math.log1p(-ratio))

    def traceparent(self, trace: RequestTrace) -> str:
        """The W3C traceparent of the request's span, returned to the client."""
        return f"00-{trace.trace_id:032x}-{trace.span_id:016x}-{trace.flags:02x}"

    def end(
        self, trace: RequestTrace, attributes: Mapping[str, Any], error: str | None = None
    ) -> None:
        """End the request's span with its last attributes (and an error description when it
        failed on the server's side): a sampled one, with the children made from its recorded
        times, is queued for the exporter."""
        if not trace.recording or self._export is None:
            return
        ended = time.monotonic()
        ns = self._ns
        own = trace.attributes
        own.update(attributes)
        if trace.queued > 1:
            own["scriptserve.requests"] = trace.queued
        self._export.put(
            (
                trace.trace_id,
                trace.span_id,
                trace.flags,
                trace.trace_state,
                trace.parent_id,
                trace.name,
                ns(trace.started),
                ns(ended),
                own,
                error,
                self._children(trace, ended),
            )
        )

    def _ns(self, monotonic_s: float) -> int:
        return int((monotonic_s + self._offset_s) * 1e9)

    # -- children, from the recorded times ---------------------------------------------------
    def _children(self, trace: RequestTrace, ended: float) -> list[Child]:
        ns = self._ns
        first = trace.jobs[0].enqueued if trace.jobs else trace.answered or ended
        decoded = ns(max(first, trace.started))
        children: list[Child] = [(-1, "decode", ns(trace.started), decoded, None, ())]
        for job, (model, version) in zip(trace.jobs, trace.job_models, strict=True):
            about = {
                "scriptserve.request.id": job.request.request_id,
                "scriptserve.model.name": model,
                "scriptserve.model.version": version,
            }
            batch = job.batch
            taken = job.dequeued or (batch.started if batch else 0.0)
            if not taken:
                continue  # never taken by a worker (cancelled, timed out in the queue)
            children.append(
                (-1, "queue", ns(job.enqueued), ns(max(taken, job.enqueued)), about, ())
            )
            if batch is not None:
                self._batch(children, job, batch, about)
        if trace.answered:
            children.append(
                (-1, "encode", ns(trace.answered), ns(max(ended, trace.answered)), None, ())
            )
        return children

    def _batch(
        self, children: list[Child], job: Job, batch: BatchRecord, about: dict[str, Any]
    ) -> None:
        ns = self._ns
        own = job.span_context
        links = [
            (*context, {"scriptserve.request.id": request_id})
            for context, request_id in batch.traced
            if context is not own
        ]
        attributes = {
            **about,  # the request id, the model and version that ran it
            "scriptserve.batch.size": len(batch.request_ids),
            "scriptserve.batch.request_ids": batch.request_ids,
            "scriptserve.worker.id": batch.worker,
        }
        index = len(children)
        started, ended = batch.started, max(batch.ended, batch.started)
        children.append((-1, "batch", ns(started), ns(ended), attributes, links))
        if batch.input_s or batch.output_s:
            model_from = min(started + batch.input_s, ended)
            model_to = max(model_from, ended - batch.output_s)
            children.append((index, "preprocess", ns(started), ns(model_from), None, ()))
            children.append((index, "inference", ns(model_from), ns(model_to), None, ()))
            children.append((index, "postprocess", ns(model_to), ns(ended), None, ()))
        else:
            children.append((index, "inference", ns(started), ns(ended), None, ()))

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is left and stop the exporter."""
        if self._export is not None:
            self._export.close(timeout_s)
            self._export = None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a package above it is missing
        return False


def _protocol_from(env: Mapping[str, str]) -> OtlpProtocol:
    value = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if value not in ("grpc", "http/protobuf"):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={value!r} is not supported; use grpc or http/protobuf"
        )
    return value  # type: ignore[return-value]


def headers_of(pairs: Sequence[tuple[str, str]] | None) -> dict[str, str]:
    """The trace-context entries of gRPC metadata or decoded HTTP headers."""
    return {k: v for k, v in pairs or () if k in (TRACEPARENT, TRACESTATE)}


def error_for_http(status: int) -> str | None:
    """A server span is an error when the server failed (5xx), not when the client did."""
    return f"HTTP {status}" if status >= 500 else None


def error_for_grpc(code: str) -> str | None:
    return code if code in GRPC_SERVER_ERRORS else None
