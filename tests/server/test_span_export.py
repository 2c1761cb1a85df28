"""The span exporter process (server/observability/span_export.py), driven as the server drives
it: records put from this thread, a real exporter process, a real OTLP/gRPC receiver. Its span
tree and links, an exporter that stops reading (records are dropped, never waited for) and one
that exits (started again), and the batches it exports."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import psutil
import pytest
from otlp import GrpcReceiver

from scriptserve.server.observability import span_export
from scriptserve.server.observability.span_export import SpanExport, SpanRecord

NOW_NS = time.time_ns()
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "20"}


def record(trace_id: int, parent_id: int = 0, error: str | None = None) -> SpanRecord:
    """A request's span and its children: decode, queue, batch (with inference under it, and a
    link to another request), encode."""
    link = (trace_id + 1, 0x1234, 1, {"scriptserve.request.id": "other"})
    children = [
        (-1, "decode", NOW_NS, NOW_NS + 10, None, ()),
        (-1, "queue", NOW_NS + 10, NOW_NS + 20, {"scriptserve.request.id": "r1"}, ()),
        (-1, "batch", NOW_NS + 20, NOW_NS + 80, {"scriptserve.batch.size": 2}, (link,)),
        (2, "inference", NOW_NS + 30, NOW_NS + 70, None, ()),
        (-1, "encode", NOW_NS + 80, NOW_NS + 90, None, ()),
    ]
    attributes = {"http.route": "/predictions/{model_name}", "http.response.status_code": 200}
    return (
        trace_id, 0xABCDEF, 1, "vendor=1", parent_id, "POST /predictions/{model_name}",
        NOW_NS, NOW_NS + 100, attributes, error, children,
    )  # fmt: skip


@pytest.fixture
def receiver() -> Iterator[GrpcReceiver]:
    found = GrpcReceiver()
    yield found
    found.stop()


@pytest.fixture
def export(receiver: GrpcReceiver) -> Iterator[SpanExport]:
    made = SpanExport("grpc", receiver.endpoint, {"service.name": "spans-test"}, FAST_EXPORT)
    yield made
    made.close(timeout_s=2.0)


def exporter_process(export: SpanExport, timeout_s: float = 15.0) -> psutil.Process:
    """The exporter process of `export`, once its sender thread has started one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in psutil.Process().children():
            try:
                if span_export.__name__ in child.cmdline() and child.status() != "zombie":
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.05)
    raise AssertionError("no span exporter process was started")


def test_a_record_becomes_the_requests_span_tree(
    export: SpanExport, receiver: GrpcReceiver
) -> None:
    trace_id, parent_id = secrets.randbits(128), secrets.randbits(64)
    export.put(record(trace_id, parent_id, error="HTTP 500"))
    spans = {s.name: s for s in receiver.trace(f"{trace_id:032x}", 6)}
    server = spans["POST /predictions/{model_name}"]
    assert server.kind == "SERVER" and server.span_id == f"{0xABCDEF:016x}"
    assert server.parent_id == f"{parent_id:016x}"
    assert server.status_code == 2  # an error on the server's side
    assert server.attributes["http.response.status_code"] == 200
    assert server.resource["service.name"] == "spans-test"
    assert (server.start_ns, server.end_ns) == (NOW_NS, NOW_NS + 100)
    for name in ("decode", "queue", "batch", "encode"):
        assert spans[name].parent_id == server.span_id and spans[name].kind == "INTERNAL"
    assert spans["inference"].parent_id == spans["batch"].span_id
    assert len({s.span_id for s in spans.values()}) == 6
    assert spans["batch"].links == [
        (f"{trace_id + 1:032x}", f"{0x1234:016x}", {"scriptserve.request.id": "other"})
    ]
    assert spans["queue"].attributes == {"scriptserve.request.id": "r1"}
    assert {s.trace_state for s in spans.values()} == {"vendor=1"}  # the client's, passed on


@pytest.mark.slow
def test_an_exporter_that_stops_reading_costs_dropped_spans_not_waits(
    export: SpanExport, receiver: GrpcReceiver
) -> None:
    """Stopped (SIGSTOP), the exporter reads nothing: its pipe fills, the sender waits on it, and
    the queue keeps at most `max_queued` spans; `put` returns at once and counts what it drops.
    Continued, it exports again."""
    first = secrets.randbits(128)
    export.put(record(first))
    receiver.trace(f"{first:032x}", 6)
    process = exporter_process(export)
    process.suspend()
    count = span_export.MAX_QUEUED_SPANS // 6 * 3
    try:
        for _ in range(count):
            export.put(record(secrets.randbits(128)))
        time.sleep(3 * span_export.SEND_INTERVAL_S)  # the sender is stuck on the full pipe
        for _ in range(count):
            export.put(record(secrets.randbits(128)))
        assert export.dropped >= count - export.max_queued // 6
    finally:
        process.resume()
    # Every request that was not dropped arrives, and nothing more.
    sent = 1 + 2 * count - export.dropped
    spans = receiver.wait_for(lambda spans: len(spans) >= 6 * sent, timeout_s=60)
    time.sleep(5 * span_export.SEND_INTERVAL_S)
    assert len(spans) == len(receiver.spans) == 6 * sent
    later = secrets.randbits(128)
    export.put(record(later))
    assert len(receiver.trace(f"{later:032x}", 6, timeout_s=30)) == 6


def test_the_queue_holds_what_otel_bsp_max_queue_size_says(receiver: GrpcReceiver) -> None:
    """The SDK's variable bounds the spans waiting to be sent, as it bounds its batch span
    processor's queue: with the exporter stopped and 300 spans allowed, 500 requests of six
    spans put at once keep at most 50 (and the sender may have taken one interval's worth
    before); those arrive once it goes on."""
    environ = {**FAST_EXPORT, "OTEL_BSP_MAX_QUEUE_SIZE": "300"}
    export = SpanExport("grpc", receiver.endpoint, {"service.name": "spans-test"}, environ)
    try:
        assert export.max_queued == 300
        first = secrets.randbits(128)
        export.put(record(first))
        receiver.trace(f"{first:032x}", 6)
        process = exporter_process(export)
        process.suspend()
        try:
            for _ in range(500):
                export.put(record(secrets.randbits(128)))
            assert 500 - 2 * 50 <= export.dropped <= 500 - 50
        finally:
            process.resume()
        sent = 1 + 500 - export.dropped
        spans = receiver.wait_for(lambda spans: len(spans) >= 6 * sent, timeout_s=60)
        time.sleep(5 * span_export.SEND_INTERVAL_S)
        assert len(spans) == len(receiver.spans) == 6 * sent
    finally:
        export.close(timeout_s=2.0)


@pytest.mark.slow
def test_an_exporter_that_exits_is_started_again(
    export: SpanExport, receiver: GrpcReceiver
) -> None:
    first = secrets.randbits(128)
    export.put(record(first))
    receiver.trace(f"{first:032x}", 6)
    gone = exporter_process(export)
    gone.kill()
    gone.wait(10)
    time.sleep(span_export.RESTART_INTERVAL_S)
    later = secrets.randbits(128)
    export.put(record(later))
    assert len(receiver.trace(f"{later:032x}", 6, timeout_s=30)) == 6
    assert exporter_process(export).pid != gone.pid


def test_close_returns_when_the_exporter_is_stuck(receiver: GrpcReceiver) -> None:
    """An exporter that never reads again is killed by `close`, which returns."""
    export = SpanExport("grpc", receiver.endpoint, {}, FAST_EXPORT)
    export.put(record(secrets.randbits(128)))
    process = exporter_process(export)
    process.suspend()
    for _ in range(span_export.MAX_QUEUED_SPANS // 6):
        export.put(record(secrets.randbits(128)))
    export.close(timeout_s=1.0)
    assert process.wait(10) is not None or not process.is_running()


def test_spans_leave_in_batches_of_the_standard_size_or_after_its_delay(
    receiver: GrpcReceiver,
) -> None:
    """OTEL_BSP_MAX_EXPORT_BATCH_SIZE and OTEL_BSP_SCHEDULE_DELAY, as the SDK's batch span
    processor reads them: a request's 6 spans wait for a batch of 12 (the delay is a minute),
    go in one export with the next request's, and what is left goes when the export closes."""
    batching = {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "12", "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    export = SpanExport("grpc", receiver.endpoint, {}, batching)
    try:
        ids = [secrets.randbits(128) for _ in range(3)]
        export.put(record(ids[0]))
        time.sleep(1.0)
        assert receiver.spans == []  # waiting for its batch
        export.put(record(ids[1]))
        spans = receiver.wait_for(lambda spans: len(spans) >= 12)
        assert len(spans) == 12 and receiver.exports == 1
        export.put(record(ids[2]))
    finally:
        export.close(timeout_s=10.0)
    assert len(receiver.spans) == 18 and receiver.exports == 2  # the last, at close
    assert {s.trace_id for s in receiver.spans} == {f"{i:032x}" for i in ids}
