"""Spans leave the server from a process of their own: the server hands each sampled request's
recorded times over as plain data, and the exporter process makes the spans and sends them.

Making a request's nine spans with OpenTelemetry's Python SDK took more of the event loop than the
rest of a request, and encoding and sending them more again on the SDK's export thread, which holds
the same GIL as the loop (benchmarks/README.md). Here the loop only appends the request's
`SpanRecord` (tuples and dicts, made in `tracing.py`) to a queue; the server's sender thread pickles
what is queued every 100 ms and writes it to the exporter's stdin; the exporter (`python -m
scriptserve.server.observability.span_export`) writes each record's spans as OTLP's protobuf bytes
(`otlp_wire.py`, in a tenth of the time of the SDK's spans and encoder) and sends them with the
SDK's OTLP exporter, configured from the tracing settings and the `OTEL_EXPORTER_OTLP_*` variables.
It batches them as the SDK's batch span processor does and from the same variables: an export once
`OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans (512) are waiting, or `OTEL_BSP_SCHEDULE_DELAY` ms (5000)
after the oldest arrived: each export costs the exporter and the collector work of its own, whatever
its size.

The loop never waits on the exporter. The exporter reads no more while it exports, so a slow
collector fills the pipe and then the server's queue: at most `OTEL_BSP_MAX_QUEUE_SIZE`
spans wait there to be sent (`MAX_QUEUED_SPANS` when it is unset: 2,048 requests of eight
spans), and a request whose spans would not fit is dropped whole, counted and logged (the one
place where spans are dropped, as the SDK's batch span processor drops spans from a queue of
that size). The exporter is started on the first record and started again (at most once every
`RESTART_INTERVAL_S`) when it exits; records wait in the queue meanwhile. It exits when its
stdin closes, at `close` or when the server is gone, after exporting what it holds.

A `SpanRecord`:

    (trace_id, span_id, flags, trace_state, parent_span_id, name, start_ns, end_ns,
     attributes, error, children)

the server span (`parent_span_id` 0 for a root; `trace_state` the W3C header, "" for none;
`error` the description of a server-side failure, or None), and its children, each

    (parent, name, start_ns, end_ns, attributes, links)

where `parent` is -1 for the server span, else the index of an earlier child, and each link is
(trace_id, span_id, flags, attributes). The exporter gives the children their span ids.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from scriptserve.server.observability.otlp_wire import SpanEncoder

log = logging.getLogger("scriptserve.tracing")

Link = tuple[int, int, int, Mapping[str, Any]]
Child = tuple[int, str, int, int, Mapping[str, Any] | None, Sequence[Link]]
SpanRecord = tuple[
    int, int, int, str, int, str, int, int, Mapping[str, Any], str | None, Sequence[Child]
]
Send = Callable[[bytes, int], object]

MAX_QUEUED_SPANS = 2048 * 8
"""Spans that may wait to be sent, unless OTEL_BSP_MAX_QUEUE_SIZE says otherwise (the SDK's own
default, 2,048, would hold about 250 requests here); a request whose spans do not fit is
dropped."""
EXPORT_SPANS = 512
"""Spans in one OTLP export, at most, unless OTEL_BSP_MAX_EXPORT_BATCH_SIZE says otherwise (the
SDK's batch span processor's default)."""
SCHEDULE_DELAY_MS = 5000
"""The longest a span waits for its export, unless OTEL_BSP_SCHEDULE_DELAY says otherwise."""
SEND_INTERVAL_S = 0.1
WAKE_AT = 256
"""Queued requests that wake the sender before its interval is up."""
RESTART_INTERVAL_S = 2.0
_FRAME = struct.Struct("<I")


class SpanExport:
    """The server's side: `put` from the event loop, a sender thread, the exporter process."""

    def __init__(
        self,
        protocol: str,
        endpoint: str | None,
        resource: Mapping[str, str],
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._argv = [
            sys.executable,
            "-m",
            __name__,
            json.dumps({"protocol": protocol, "endpoint": endpoint, "resource": dict(resource)}),
        ]
        self._environ = None if environ is None else {**os.environ, **environ}
        self.max_queued = _positive(
            self._environ or os.environ, "OTEL_BSP_MAX_QUEUE_SIZE", MAX_QUEUED_SPANS
        )
        """Spans that may wait to be sent; a request whose spans do not fit is dropped."""
        self._queue: deque[SpanRecord] = deque()
        self._spans_put = 0
        """Spans queued so far: counted by `put` alone (the event loop's thread)."""
        self._spans_taken = 0
        """Spans the sender has taken from the queue: counted by the sender's thread alone. Each
        count has one writer, so their difference, the spans waiting, needs no lock."""
        self._due = threading.Event()
        self._closed = False
        self._process: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self.dropped = 0
        """Requests whose spans were dropped because the queue was full (added to by `put`
        only)."""
        self._told_dropped = 0
        self._thread = threading.Thread(
            target=self._send_when_due, name="scriptserve-spans", daemon=True
        )
        self._thread.start()

    def put(self, record: SpanRecord) -> None:
        """Queue one request's spans (from the event loop: never blocks)."""
        queue = self._queue
        spans = 1 + len(record[10])  # the server span and its children
        if self._spans_put - self._spans_taken + spans > self.max_queued:
            self.dropped += 1
            return
        self._spans_put += spans
        queue.append(record)
        if len(queue) == WAKE_AT:
            self._due.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then let the exporter export what it holds and exit (killed
        when it takes longer than `timeout_s`)."""
        self._closed = True
        self._due.set()
        self._thread.join(timeout_s)
        process = self._process
        if process is None:
            return
        if self._thread.is_alive():  # stuck writing to an exporter that stopped reading
            process.kill()
        else:
            assert process.stdin is not None
            process.stdin.close()  # its end of input: it flushes and exits
        try:
            process.wait(timeout_s + 1.0)
        except subprocess.TimeoutExpired:
            log.warning("the span exporter took over %.1f s to flush; killed", timeout_s)
            process.kill()
            process.wait()
        self._process = None

    # -- the sender thread -------------------------------------------------------------------
    def _send_when_due(self) -> None:
        while not self._closed:
            self._due.wait(SEND_INTERVAL_S)
            self._due.clear()
            self._send()
        self._send()

    def _send(self) -> None:
        if self.dropped != self._told_dropped:
            log.warning(
                "tracing dropped the spans of %d requests (the exporter could not keep up)",
                self.dropped - self._told_dropped,
            )
            self._told_dropped = self.dropped
        queue = self._queue
        if not queue:
            return
        process = self._running()
        if process is None:
            return  # the records wait for the exporter's restart
        batch = [queue.popleft() for _ in range(len(queue))]
        self._spans_taken += sum(1 + len(record[10]) for record in batch)
        payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        assert process.stdin is not None
        try:
            _write_all(process.stdin, _FRAME.pack(len(payload)) + payload)
        except OSError:  # it exited while this was written
            # Counted apart from `dropped`, which only the event loop's thread adds to.
            log.warning("tracing lost the spans of %d requests: the exporter exited", len(batch))

    def _running(self) -> subprocess.Popen[bytes] | None:
        """The exporter process, started (again) when it is not running; None while it may
        not be restarted yet."""
        process = self._process
        if process is not None and process.poll() is None:
            return process
        now = time.monotonic()
        if process is not None:
            log.warning(
                "the span exporter exited with code %s; starting it again", process.returncode
            )
            self._process = None
        if now - self._started_at < RESTART_INTERVAL_S:
            return None
        self._started_at = now
        self._process = subprocess.Popen(
            self._argv, stdin=subprocess.PIPE, bufsize=0, env=self._environ
        )
        return self._process


def _write_all(stream: IO[bytes], data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = stream.write(view)
        view = view[written or 0 :]


# -- the exporter process ----------------------------------------------------------------------
class Exporter:
    """Turns `SpanRecord`s into spans and exports them over OTLP: encoded here
    (`otlp_wire.SpanEncoder`) and sent by the SDK's exporter, or, where the installed SDK's
    exporter cannot send what it did not encode, as the SDK's `ReadableSpan`s."""

    def __init__(
        self,
        protocol: str,
        endpoint: str | None,
        resource: Mapping[str, str],
        environ: Mapping[str, str] = os.environ,
        encode: bool = True,
    ) -> None:
        """`encode` False always takes the SDK's spans and encoder (the reference the encoding
        here is tested against)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from scriptserve import __version__

        self._resource = Resource.create(dict(resource))
        self._scope = InstrumentationScope("scriptserve", __version__)
        self.otlp, self._send = _exporter(protocol, endpoint, encode)
        """Sends an encoded export request and its span count; None: the SDK encodes."""
        self._encoder = SpanEncoder(
            self._resource.attributes, "scriptserve", __version__, _trace_state
        )
        self.batch_size = _positive(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", EXPORT_SPANS)
        self.delay_s = _positive(environ, "OTEL_BSP_SCHEDULE_DELAY", SCHEDULE_DELAY_MS) / 1e3
        self.pending: list[Any] = []
        """Spans waiting for their export: encoded (bytes), or the SDK's."""
        self.due: float | None = None
        """time.monotonic() by which the pending spans are to be exported; None when none
        are."""

    def add(self, records: Sequence[SpanRecord]) -> None:
        """The spans of `records` wait for their export; every full batch goes at once."""
        spans = self.spans if self._send is None else self._encoder.spans
        for record in records:
            self.pending.extend(spans(record))
        if self.pending and self.due is None:
            self.due = time.monotonic() + self.delay_s
        while len(self.pending) >= self.batch_size:
            self._export(self.batch_size)
        if not self.pending:
            self.due = None

    def flush(self) -> None:
        """Export every pending span."""
        while self.pending:
            self._export(self.batch_size)
        self.due = None

    def _export(self, count: int) -> None:
        """Export the first `count` pending spans, waiting for the collector's answer (the OTLP
        exporter retries and logs its failures)."""
        spans, self.pending = self.pending[:count], self.pending[count:]
        if self._send is None:
            self.otlp.export(spans)
        else:
            self._send(self._encoder.request(spans), len(spans))

    def spans(self, record: SpanRecord) -> list[Any]:
        """The SDK's spans of one request."""
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import (
            Link,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            TraceState,
        )

        trace_id, span_id, flags, state, parent_id, name, start, end = record[:8]
        attributes, error, children = record[8:]
        trace_flags = TraceFlags(flags)
        trace_state = TraceState.from_header([state]) if state else None
        context = SpanContext(trace_id, span_id, False, trace_flags, trace_state)
        parent = (
            SpanContext(trace_id, parent_id, True, trace_flags, trace_state) if parent_id else None
        )
        status = Status(StatusCode.ERROR, error) if error is not None else Status(StatusCode.UNSET)
        resource, scope = self._resource, self._scope
        server = ReadableSpan(
            name,
            context,
            parent,
            attributes=attributes,
            kind=SpanKind.SERVER,
            status=status,
            start_time=start,
            end_time=end,
            resource=resource,
            instrumentation_scope=scope,
        )
        spans = [server]
        contexts: list[SpanContext] = []
        for parent_index, child_name, child_start, child_end, child_attributes, links in children:
            own = SpanContext(
                trace_id, random.getrandbits(64) or 1, False, trace_flags, trace_state
            )
            contexts.append(own)
            spans.append(
                ReadableSpan(
                    child_name,
                    own,
                    context if parent_index < 0 else contexts[parent_index],
                    attributes=child_attributes,
                    links=[
                        Link(SpanContext(t, s, False, TraceFlags(f)), linked)
                        for t, s, f, linked in links
                    ],
                    start_time=child_start,
                    end_time=child_end,
                    resource=resource,
                    instrumentation_scope=scope,
                )
            )
        return spans


def _exporter(protocol: str, endpoint: str | None, encode: bool) -> tuple[Any, Send | None]:
    """The OTLP span exporter, and what sends it an export request encoded here (None when not
    to `encode`, or where the installed SDK's exporter takes only its own spans). `endpoint`
    None leaves it to the OTEL_* variables (and then to the protocol's default, localhost:4317
    or :4318). Either way the SDK's exporter reads its settings, connects, compresses, retries
    and logs its failures."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        if not (encode and callable(getattr(GrpcExporter, "_translate_data", None))):
            return GrpcExporter(endpoint=endpoint), None

        class EncodedExporter(GrpcExporter):
            """Exports what it is given as an encoded request and its span count: the hook
            through which the SDK's own exporter turns its spans into the request."""

            def _translate_data(self, data: Any) -> Any:
                return ExportTraceServiceRequest.FromString(data[0])

            def _count_data(self, data: Any) -> int:
                return int(data[1])

        grpc_exporter = EncodedExporter(endpoint=endpoint)
        return grpc_exporter, lambda payload, count: grpc_exporter.export((payload, count))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    http_exporter = HttpExporter(endpoint=endpoint)
    post = getattr(getattr(http_exporter, "_client", None), "export", None)
    if not (encode and callable(post)):
        return http_exporter, None
    return http_exporter, lambda payload, count: post(payload)


def _trace_state(header: str) -> str:
    """A span's trace_state as the SDK's encoder writes it: the header's well-formed members."""
    from opentelemetry.trace import TraceState

    return ",".join(f"{key}={value}" for key, value in TraceState.from_header([header]).items())


def _positive(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name, "")
    try:
        found = int(value) if value else default
    except ValueError:
        found = 0
    if found <= 0:
        log.warning("%s=%r is not a positive integer; %d is used", name, value, default)
        return default
    return found


def _read(fd: int, size: int) -> bytes | None:
    """`size` bytes from `fd`, or None at its end."""
    parts: list[bytes] = []
    left = size
    while left:
        part = os.read(fd, left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _next_batch(fd: int) -> list[SpanRecord] | None:
    """The next pickled batch of records on `fd`, or None at its end."""
    head = _read(fd, _FRAME.size)
    if head is None:
        return None
    (size,) = _FRAME.unpack(head)
    payload = _read(fd, size)
    return None if payload is None else pickle.loads(payload)  # from the server, its parent


def main(argv: list[str] | None = None) -> int:
    """The exporter process: batches of records from stdin, their spans exported as they
    fill a batch or wait their delay, until stdin closes; then what is left."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s span exporter: %(message)s"
    )
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    exporter = Exporter(config["protocol"], config["endpoint"], config["resource"])
    fd = sys.stdin.fileno()
    try:
        while True:
            due = exporter.due
            wait = None if due is None else max(0.0, due - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                exporter.flush()  # the oldest span waited its delay
                continue
            batch = _next_batch(fd)
            if batch is None:
                break
            exporter.add(batch)
    finally:
        exporter.flush()
        exporter.otlp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
