"""An OTLP/gRPC trace receiver that only counts: where the tracing benchmark's spans go.

    python -m benchmarks.otlp_sink --port 4317     # prints the spans it received on SIGTERM

It decodes every export as a collector would (opentelemetry-proto's TraceService), in its own
process, and answers at once.
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class CountingService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        spans = sum(
            len(scope.spans)
            for resource in request.resource_spans
            for scope in resource.scope_spans
        )
        with self._lock:
            self.spans += spans
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.otlp_sink", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    service = CountingService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"listening on 127.0.0.1:{args.port}", flush=True)
    stop.wait()
    server.stop(0)
    print(f"spans={service.spans} exports={service.exports}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
