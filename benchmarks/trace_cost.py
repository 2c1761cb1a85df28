"""What one sampled request's trace costs the event loop, in-process: the server span opened, the
model and one queued job noted, a one-request batch recorded, the answer noted, the
`traceparent` made and the span ended (server/observability/tracing.py), the way the data plane
and the HTTP cycle call them. Spans go over OTLP/gRPC (or OTLP/HTTP, the server's default, with
`--protocol http/protobuf`) to `benchmarks/otlp_sink.py` in a process of its own.

    python -m benchmarks.trace_cost [--before <python of another tree>] [--rounds 10]
        [--protocol grpc|http/protobuf]

Prints, for this tree (and the other, run as `python -m benchmarks.trace_cost --child` with
that python): the median of the rounds' microseconds of the calling thread per request (what
the event loop pays) and the process's CPU per request, with its threads (what else the server
pays: for a tree that exports from its own threads, their work; the exporter process's is not
counted here), the exporter process's CPU per request (for a tree that has one), and the spans
the receiver got. Writes benchmarks/results/trace_cost-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from benchmarks import otlp_sink, report
from benchmarks.servers import free_port

PER_ROUND = 500


def measure(endpoint: str, rounds: int, protocol: str = "grpc") -> dict[str, Any]:
    """This interpreter's tree, measured in this process."""
    from scriptserve.handlers.base import InferenceRequest
    from scriptserve.server.observability.tracing import Tracing
    from scriptserve.server.workers.batching import Job
    from scriptserve.server.workers.delivery import traced

    otlp = "grpc" if protocol == "grpc" else "http/protobuf"
    tracing = Tracing(True, endpoint=endpoint, protocol=otlp, sampling_ratio=1.0)
    loop = asyncio.new_event_loop()
    route = "/v2/models/{model_name}/infer"

    def one() -> None:
        trace = tracing.start(
            "POST", {}, {"http.request.method": "POST", "url.path": "/v2/models/m/infer"}
        )
        job = Job(InferenceRequest(), loop.create_future(), time.monotonic() + 5)
        if hasattr(trace, "note_queued"):  # a tree that noted the model and the job apart
            trace.note_model("m", "1")
            trace.note_queued(job, "m", "1")
        else:
            job.span_context = trace.context
            trace.note_model("m", "1", jobs=(job,))
        job.dequeued = time.monotonic()
        record = traced([job], 1, job.dequeued)
        assert record is not None
        record.ended, record.input_s, record.output_s = time.monotonic(), 1e-5, 1e-5
        trace.note_answered()
        tracing.traceparent(trace)
        if hasattr(trace, "span"):  # a tree whose trace holds the SDK's span
            trace.span.update_name(f"POST {route}")
        else:
            trace.name = f"POST {route}"
        tracing.end(trace, {"http.response.status_code": 200, "http.route": route})

    for _ in range(PER_ROUND):  # warm
        one()
    time.sleep(1.0)
    loop_us: list[float] = []
    cpu_us: list[float] = []
    children_us: list[float] = []
    for _ in range(rounds):
        cpu, children = time.process_time(), _children_cpu_s()
        started = time.perf_counter()
        for _ in range(PER_ROUND):
            one()
        loop_us.append((time.perf_counter() - started) / PER_ROUND * 1e6)
        time.sleep(1.0)  # the export side catches up; its CPU counts below
        cpu_us.append((time.process_time() - cpu) / PER_ROUND * 1e6)
        children_us.append((_children_cpu_s() - children) / PER_ROUND * 1e6)
    tracing.close(timeout_s=10.0)
    loop.close()
    return {
        "loop_us": loop_us,
        "loop_us_median": statistics.median(loop_us),
        "process_cpu_us": cpu_us,
        "process_cpu_us_median": statistics.median(cpu_us),
        "exporter_process_cpu_us": children_us,
        "exporter_process_cpu_us_median": statistics.median(children_us),
        "requests": PER_ROUND * (rounds + 1),
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's children (a tree's exporter process) so far."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--before", help="python of another tree, measured the same way")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc")
    p.add_argument("--child", help=argparse.SUPPRESS)  # an endpoint: measure, print JSON
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.rounds, args.protocol)))
        return 0
    load_before = os.getloadavg()
    pythons = {"this tree": sys.executable}
    if args.before:
        pythons["before"] = args.before
    found: dict[str, Any] = {}
    with otlp_sink.running(free_port(), args.protocol) as sink:
        for label, python in pythons.items():
            command = [python, "-m", "benchmarks.trace_cost", "--child", sink.endpoint]
            command += ["--protocol", args.protocol]
            out = subprocess.run(
                [*command, "--rounds", str(args.rounds)], capture_output=True, text=True, check=True
            )
            found[label] = measured = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{label}: {measured['loop_us_median']:.1f} us of the loop per sampled request "
                f"(rounds {min(measured['loop_us']):.1f}-{max(measured['loop_us']):.1f}), "
                f"{measured['process_cpu_us_median']:.1f} us of the process's CPU, "
                f"{measured['exporter_process_cpu_us_median']:.1f} us of its exporter process's"
            )
    received = sink.received
    print(f"OTLP receiver: {received}")
    host = report.closing({}, load_before)
    report.write_results(
        "trace_cost",
        {
            "benchmark": "trace_cost",
            "per_round": PER_ROUND,
            "rounds": args.rounds,
            "protocol": args.protocol,
            "before": args.before,
            "results": found,
            "otlp_receiver": received,
            "host": host,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
