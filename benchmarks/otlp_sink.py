"""An OTLP trace receiver that only counts: where the tracing benchmarks' spans go.

    python -m benchmarks.otlp_sink --port 4317          # prints the spans it received on SIGTERM
    python -m benchmarks.otlp_sink --port 4318 --http   # OTLP/HTTP: POST /v1/traces

It decodes every export as a collector would (opentelemetry-proto's TraceService, or the
protobuf body of OTLP/HTTP), in its own process, and answers at once. `running()` starts one
for a benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class CountingService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.spans = 0
        self.exports = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        self.count(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def count(self, request: Any) -> None:
        spans = sum(
            len(scope.spans)
            for resource in request.resource_spans
            for scope in resource.scope_spans
        )
        with self._lock:
            self.spans += spans
            self.exports += 1


def http_server(take: Callable[[Any], None], port: int = 0) -> ThreadingHTTPServer:
    """OTLP/HTTP with protobuf bodies (POST /v1/traces) on `port` (0: any free one): `take` is
    given each export's ExportTraceServiceRequest. Not started: serve_forever it."""
    reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a collector serves it

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


@dataclass
class Sink:
    endpoint: str
    pid: int
    received: str = ""
    """What it printed when it stopped: `spans=N exports=M`."""


@contextlib.contextmanager
def running(port: int, protocol: str = "grpc") -> Iterator[Sink]:
    """A sink in a process of its own on `port`, listening over `protocol` (`grpc` or
    `http/protobuf`), until the block ends; then its `received` says what it counted. Its
    `endpoint` is what an exporter of that protocol is given."""
    http = protocol != "grpc"
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.otlp_sink", "--port", str(port)]
        + (["--http"] if http else []),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.readline()  # listening
    endpoint = f"http://127.0.0.1:{port}" + ("/v1/traces" if http else "")
    sink = Sink(endpoint, process.pid)
    try:
        yield sink
    finally:
        process.send_signal(signal.SIGTERM)
        sink.received = process.communicate(timeout=30)[0].strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.otlp_sink", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--http", action="store_true", help="OTLP/HTTP (protobuf), not gRPC")
    args = p.parse_args(argv)
    service = CountingService()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.http:
        http = http_server(service.count, args.port)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        print(f"listening on 127.0.0.1:{args.port} (OTLP/HTTP)", flush=True)
        stop.wait()
        http.shutdown()
    else:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
        server.add_insecure_port(f"127.0.0.1:{args.port}")
        server.start()
        print(f"listening on 127.0.0.1:{args.port}", flush=True)
        stop.wait()
        server.stop(0)
    print(f"spans={service.spans} exports={service.exports}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
