"""A real OTLP trace receiver on loopback, over gRPC (opentelemetry-proto's TraceService) or
HTTP (POST /v1/traces, protobuf): what a collector would get from the server, as plain spans."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from benchmarks.otlp_sink import http_server

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]
    """(trace id, span id, attributes) of each link."""
    status_code: int
    """0 unset, 1 ok, 2 error."""
    resource: dict[str, Any]
    trace_state: str = ""
    """The W3C tracestate the span carries."""


class Receiver:
    """Collects every span exported to it; `spans_of(trace_id)` waits for them."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.exports = 0
        self._lock = threading.Condition()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    found.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=KINDS.get(s.kind, "UNSPECIFIED"),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=[
                                (
                                    link.trace_id.hex(),
                                    link.span_id.hex(),
                                    {a.key: _value(a.value) for a in link.attributes},
                                )
                                for link in s.links
                            ],
                            status_code=s.status.code,
                            resource=resource,
                            trace_state=s.trace_state,
                        )
                    )
        with self._lock:
            self.spans.extend(found)
            self.exports += 1
            self._lock.notify_all()

    def wait_for(self, check: Any, timeout_s: float = 15.0) -> list[Span]:
        """The spans received, once `check(spans)` is true (or the time is up)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not check(self.spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)
            return list(self.spans)

    def trace(self, trace_id: str, count: int, timeout_s: float = 15.0) -> list[Span]:
        """The spans of one trace, once at least `count` of them arrived."""
        spans = self.wait_for(
            lambda all_: sum(s.trace_id == trace_id for s in all_) >= count, timeout_s
        )
        return [s for s in spans if s.trace_id == trace_id]


class GrpcReceiver(Receiver):
    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:
                receiver.take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


class HttpReceiver(Receiver):
    """OTLP/HTTP with protobuf bodies; `endpoint` is the base (the exporter adds /v1/traces)."""

    def __init__(self) -> None:
        super().__init__()
        self.server = http_server(self.take)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
