"""OTLP's export request written from span records (server/observability/otlp_wire.py), held
against the SDK's own encoder of the same spans, and sent by the exporter over gRPC and HTTP to
real receivers."""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp import GrpcReceiver, HttpReceiver, Receiver

from scriptserve.server.observability.otlp_wire import SpanEncoder, any_value
from scriptserve.server.observability.span_export import Exporter, SpanRecord

NOW_NS = time.time_ns()
RESOURCE = {"service.name": "wire-test"}


def record(
    trace_id: int,
    parent_id: int = 0,
    error: str | None = None,
    state: str = "",
    long_text: str = "",
) -> SpanRecord:
    """A request's spans with every kind of field: a remote parent or none, a trace state, an
    error, nested children, links, and attributes of each type OTLP carries."""
    link = (trace_id + 1, 0x1234, 1, {"scriptserve.request.id": "other", "n": 3})
    attributes = {
        "http.route": "/v2/models/{model_name}/infer",
        "http.response.status_code": 200,
        "scriptserve.flag": True,
        "scriptserve.off": False,
        "scriptserve.offset": -7,
        "scriptserve.big": 2**62,
        "scriptserve.share": 0.25,
        "scriptserve.ids": ["a", "b", long_text],
        "scriptserve.sizes": [1, 2, 300],
        "scriptserve.raw": b"\x00\xff",
        "scriptserve.text": long_text or "é ✓",
    }
    children = [
        (-1, "decode", NOW_NS, NOW_NS + 10, None, ()),
        (-1, "queue", NOW_NS + 10, NOW_NS + 20, {"scriptserve.request.id": "r1"}, ()),
        (-1, "batch", NOW_NS + 20, NOW_NS + 80, {"scriptserve.batch.size": 2}, (link, link)),
        (2, "preprocess", NOW_NS + 20, NOW_NS + 30, None, ()),
        (2, "inference", NOW_NS + 30, NOW_NS + 70, None, ()),
        (-1, "encode", NOW_NS + 80, NOW_NS + 90, {}, ()),
    ]
    return (
        trace_id, 0xABCDEF, 1, state, parent_id, "POST /v2/models/{model_name}/infer",
        NOW_NS, NOW_NS + 100, attributes, error, children,
    )  # fmt: skip


RECORDS = {
    "a root": record(secrets.randbits(128)),
    "under a client's span, with its trace state": record(
        secrets.randbits(128), secrets.randbits(64), state="vendor=a1,other=b2"
    ),
    "a malformed trace state": record(secrets.randbits(128), 5, state="vendor=a1,=bad,x"),
    "a server-side error": record(secrets.randbits(128), error="the worker was lost"),
    "fields longer than a byte's length": record(secrets.randbits(128), long_text="x" * 20_000),
}


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    made = Exporter("grpc", "http://127.0.0.1:9", RESOURCE)
    yield made
    made.otlp.shutdown()


def both(exporter: Exporter, records: list[SpanRecord]) -> tuple[object, object]:
    """The export request of `records` from the SDK's spans and encoder, and from the bytes
    written here, with the same child span ids (both draw them from `random` in order)."""
    random.seed(7)
    theirs = encode_spans([span for r in records for span in exporter.spans(r)])
    random.seed(7)
    encoder = exporter._encoder
    ours = encoder.request([span for r in records for span in encoder.spans(r)])
    return theirs, ExportTraceServiceRequest.FromString(ours)


@pytest.mark.parametrize("name", list(RECORDS))
def test_a_record_encodes_as_the_sdk_encodes_its_spans(exporter: Exporter, name: str) -> None:
    theirs, ours = both(exporter, [RECORDS[name]])
    assert ours == theirs
    spans = ours.resource_spans[0].scope_spans[0].spans  # type: ignore[attr-defined]
    assert len(spans) == 7 and spans[0].kind == 2  # the server span, then its children


def test_a_batch_of_records_is_one_request_of_one_resource_and_scope(exporter: Exporter) -> None:
    records = list(RECORDS.values()) * 20  # lengths of several varint bytes
    theirs, ours = both(exporter, records)
    assert ours == theirs
    (resource_spans,) = ours.resource_spans  # type: ignore[attr-defined]
    (scope_spans,) = resource_spans.scope_spans
    assert scope_spans.scope.name == "scriptserve" and len(scope_spans.spans) == 7 * len(records)


def test_equal_values_of_other_types_keep_their_types() -> None:
    """1, 1.0 and True are equal (and hash alike) in Python: each keeps its own AnyValue."""
    encoder = SpanEncoder({}, "s", "1")
    values = [encoder._attributes(b"\x4a", {"k": value}) for value in (1, 1.0, True, 1, True)]
    assert len(set(values[:3])) == 3 and values[3] == values[0] and values[4] == values[2]


def test_a_value_otlp_cannot_carry_is_left_out_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    encoder = SpanEncoder({}, "s", "1")
    with caplog.at_level(logging.ERROR, logger="scriptserve.tracing"):
        encoded = encoder._attributes(b"\x4a", {"bad": object(), "good": "yes", "huge": 2**63})
    assert encoded == encoder._attributes(b"\x4a", {"good": "yes"})
    assert "span attribute bad is left out" in caplog.text
    assert "span attribute huge is left out: an attribute's int must fit in 64 bits" in caplog.text
    with pytest.raises(TypeError, match="cannot be a object"):
        any_value(object())


@pytest.mark.parametrize(
    ("protocol", "encode"),
    [("grpc", True), ("http/protobuf", True), ("grpc", False), ("http/protobuf", False)],
)
def test_the_exporter_sends_a_records_spans(protocol: str, encode: bool) -> None:
    """Encoded here and sent by the SDK's exporter (over gRPC through its hook, over HTTP
    through its client), or made and encoded by the SDK (where its exporter has neither)."""
    receiver: Receiver
    if protocol == "grpc":
        receiver = GrpcReceiver()
        endpoint = receiver.endpoint
    else:
        receiver = HttpReceiver()
        endpoint = f"{receiver.endpoint}/v1/traces"
    exporter = Exporter(protocol, endpoint, RESOURCE, encode=encode)
    try:
        assert (exporter._send is not None) == encode
        trace_id, parent_id = secrets.randbits(128), secrets.randbits(64)
        exporter.add([record(trace_id, parent_id, error="failed", state="vendor=a1")])
        exporter.flush()
        spans = {s.name: s for s in receiver.trace(f"{trace_id:032x}", 7)}
    finally:
        exporter.otlp.shutdown()
        receiver.stop()
    server = spans["POST /v2/models/{model_name}/infer"]
    assert server.parent_id == f"{parent_id:016x}" and server.status_code == 2
    assert server.attributes["scriptserve.ids"] == ["a", "b", ""]
    assert server.resource["service.name"] == "wire-test"
    assert spans["inference"].parent_id == spans["batch"].span_id
    assert spans["batch"].links[0][2] == {"scriptserve.request.id": "other", "n": 3}
    assert {s.trace_state for s in spans.values()} == {"vendor=a1"}


def test_text_that_is_not_utf8_is_replaced_not_sent_broken() -> None:
    """A lone surrogate would make the request's bytes invalid UTF-8, which a collector refuses
    whole: it is sent as "?"."""
    encoder = SpanEncoder({}, "s", "1")
    trace_id = secrets.randbits(128)
    broken = (*record(trace_id)[:8], {"path": "/a\udc80b"}, "failed \udc80", [])
    request = ExportTraceServiceRequest.FromString(encoder.request(encoder.spans(broken)))
    (span,) = request.resource_spans[0].scope_spans[0].spans
    assert span.attributes[0].value.string_value == "/a?b"
    assert span.status.message == "failed ?"
