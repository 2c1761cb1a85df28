"""An OTLP/gRPC trace receiver that only counts: where the tracing benchmark's spans go.

    python -m benchmarks.otlp_sink --port 4317     # prints the spans it received on SIGTERM

It decodes every export as a collector would (opentelemetry-proto's TraceService), in its own
process, and answers at once. `running()` starts one for a benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
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


@dataclass
class Sink:
    endpoint: str
    pid: int
    received: str = ""
    """What it printed when it stopped: `spans=N exports=M`."""


@contextlib.contextmanager
def running(port: int) -> Iterator[Sink]:
    """A sink in a process of its own on `port`, listening, until the block ends; then its
    `received` says what it counted."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.otlp_sink", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.readline()  # listening
    sink = Sink(f"http://127.0.0.1:{port}", process.pid)
    try:
        yield sink
    finally:
        process.send_signal(signal.SIGTERM)
        sink.received = process.communicate(timeout=30)[0].strip()


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
