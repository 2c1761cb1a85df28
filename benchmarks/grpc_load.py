"""Scenario A over the Open Inference Protocol's gRPC API with raw tensors, beside REST.

    python -m benchmarks.grpc_load            # 3 rounds of 10 s runs; about 6 minutes
    python -m benchmarks.grpc_load --quick    # 1 round of 3 s runs; about 1 minute

One scriptserve serves scenario A's MLP (512-1024-1024-10, batching on) over both protocols, and
each round loads it in turn with one row per request: REST with a JSON row to /predictions and
with OIP's binary tensor extension to /v2/models/mlp/infer (wrk, 32 connections), and gRPC
ModelInfer with `raw_input_contents` (h2load; 32 connections of one stream, then one connection
of 32 streams), and with grpc_loadgen (benchmarks/grpc_client, C++): 32 clients of one request
outstanding each, as back-to-back ModelInfer calls and as one ModelStreamInfer stream per client.
Trivial requests (GET /v2/health/live, gRPC ServerLive) show the load generators' headroom.
Before any load, each request is checked to be answered with the model's output, and an h2load
run and grpc_loadgen runs (unary, stream) of a fixed count must each raise the server's count of
gRPC 200s by exactly that count; over every measured run the server's count of 200s is compared
with the client's successes (for grpc_loadgen, exactly with all its successes).
The results are also written to benchmarks/results/grpc_load-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import struct
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from benchmarks import report
from benchmarks.loadgen import (
    GrpcLoadResult,
    LoadResult,
    Run,
    grpc_loadgen_path,
    h2load_path,
    run_grpc_loadgen,
    run_h2load,
    run_wrk,
    wrk_path,
)
from benchmarks.models import BenchModel, build
from benchmarks.scenarios import median
from benchmarks.servers import ServerProcess, scriptserve
from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip

RESULTS = Path(__file__).resolve().parent / "results"
SERVICE = "/inference.GRPCInferenceService"
GRPC_HEADERS = {"content-type": "application/grpc", "te": "trailers"}
HEADER_LENGTH = "Inference-Header-Content-Length"
CHECK_REQUESTS = 2000
"""The h2load and grpc_loadgen runs before loading: the server must count each request as a gRPC
200."""
CPP_MODES = ("unary", "stream")
MODEL = "mlp"
LoadFn = Callable[[float], LoadResult]


@dataclass(frozen=True)
class Options:
    seconds: float
    warmup: float
    repeats: int
    wrk_threads: int
    h2load_threads: int
    cpp_threads: int
    workers: int
    intra_op_threads: int
    max_batch_size: int


@dataclass(frozen=True)
class Bodies:
    """The request bodies on disk, each holding the same float32 row."""

    json: Path
    """TorchServe-style JSON row, for /predictions (the body http_load sends)."""
    oip: Path
    """OIP REST binary extension: a JSON header, then the row's raw little-endian bytes."""
    oip_header_length: int
    grpc_infer: Path
    """A gRPC frame (flag 0, 4-byte big-endian length) holding the ModelInferRequest."""
    grpc_live: Path
    expected: np.ndarray
    """The model's output for the row, computed in-process."""
    grpc_message: Path
    """The ModelInferRequest alone (no gRPC frame), as grpc_loadgen reads it."""


def grpc_frame(message: Any) -> bytes:
    """A gRPC length-prefixed message, uncompressed: what goes in the HTTP/2 DATA frames."""
    data: bytes = message.SerializeToString()
    return b"\0" + struct.pack(">I", len(data)) + data


def write_bodies(model: BenchModel, workdir: Path) -> Bodies:
    row = np.asarray(json.loads(model.body.read_text()), dtype="<f4")[None]
    raw = row.tobytes()
    infer = oip.ModelInferRequest(model_name=model.name)
    infer.inputs.add(name="x", datatype="FP32", shape=list(row.shape))
    infer.raw_input_contents.append(raw)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(row.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "parameters": {"binary_data_output": True},
        },
        separators=(",", ":"),
    ).encode()
    names = ("oip", "infer", "live", "message")
    paths = {name: workdir / f"{model.name}-{name}.bin" for name in names}
    paths["oip"].write_bytes(header + raw)
    paths["infer"].write_bytes(grpc_frame(infer))
    paths["message"].write_bytes(infer.SerializeToString())
    paths["live"].write_bytes(grpc_frame(oip.ServerLiveRequest()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(model.scripted)).eval()  # type: ignore[no-untyped-call]
    with torch.inference_mode():
        expected = module(torch.from_numpy(row)).numpy()
    return Bodies(
        model.body,
        paths["oip"],
        len(header),
        paths["infer"],
        paths["live"],
        expected,
        paths["message"],
    )


# -- checks before loading ---------------------------------------------------------------------
def _post(url: str, body: bytes, headers: Mapping[str, str]) -> tuple[bytes, Mapping[str, str]]:
    request = urllib.request.Request(url, body, dict(headers), method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read(), answer.headers


def _grpc_call(address: str, method: str, frame: bytes) -> bytes:
    """One unary call with grpcio, sending the frame's message bytes exactly as h2load does."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(SERVICE + "/" + method)
        answer: bytes = call(frame[5:], timeout=10)
        return answer


def _grpc_stream(address: str, message: bytes, count: int) -> list[bytes]:
    """One ModelStreamInfer call with grpcio writing `message` `count` times: the answers."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(SERVICE + "/ModelStreamInfer")
        return list(call(iter([message] * count), timeout=10))


def _close(name: str, got: np.ndarray, expected: np.ndarray) -> float:
    if got.size != expected.size or not np.allclose(got.ravel(), expected.ravel(), atol=1e-5):
        raise SystemExit(f"{name}: the answer {got.ravel()} is not the model's {expected.ravel()}")
    return float(np.abs(got.ravel() - expected.ravel()).max())


def settled_counts(server: ServerProcess, deadline_s: float = 5.0) -> dict[tuple[str, str], int]:
    """The server's request counts once two reads agree: requests in flight when a client
    stopped are still answered (or cancelled) and counted just after."""
    counts = server.request_counts()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        again = server.request_counts()
        if again == counts:
            break
        counts = again
    return counts


def _delta(after: Mapping[Any, int], before: Mapping[Any, int]) -> dict[Any, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def verify(server: ServerProcess, bodies: Bodies, opts: Options) -> dict[str, Any]:
    """Each request body is answered with the model's output, and the server counts every
    request of a fixed-count h2load run as a gRPC 200; raises SystemExit otherwise."""
    assert server.grpc_address is not None
    found: dict[str, Any] = {}
    answer = oip.ModelInferResponse.FromString(
        _grpc_call(server.grpc_address, "ModelInfer", bodies.grpc_infer.read_bytes())
    )
    out = answer.outputs[0]
    if out.datatype != "FP32" or list(out.shape) != list(bodies.expected.shape):
        raise SystemExit(f"gRPC ModelInfer: output {out.datatype} {list(out.shape)} unexpected")
    got = np.frombuffer(answer.raw_output_contents[0], "<f4")
    found["grpc_max_abs_diff"] = _close("gRPC ModelInfer", got, bodies.expected)
    answers = _grpc_stream(server.grpc_address, bodies.grpc_message.read_bytes(), 3)
    if len(answers) != 3:
        raise SystemExit(f"gRPC ModelStreamInfer: 3 requests got {len(answers)} answers")
    diffs = []
    for data in answers:
        streamed = oip.ModelStreamInferResponse.FromString(data)
        if streamed.error_message:
            raise SystemExit(f"gRPC ModelStreamInfer: error_message {streamed.error_message!r}")
        got = np.frombuffer(streamed.infer_response.raw_output_contents[0], "<f4")
        diffs.append(_close("gRPC ModelStreamInfer", got, bodies.expected))
    found["grpc_stream_max_abs_diff"] = max(diffs)
    live = oip.ServerLiveResponse.FromString(
        _grpc_call(server.grpc_address, "ServerLive", bodies.grpc_live.read_bytes())
    )
    if not live.live:
        raise SystemExit("gRPC ServerLive answered live=false")
    body, _ = _post(
        f"{server.url}/predictions/{MODEL}",
        bodies.json.read_bytes(),
        {"Content-Type": "application/json"},
    )
    got = np.asarray(json.loads(body), np.float32)
    found["rest_json_max_abs_diff"] = _close("REST /predictions", got, bodies.expected)
    body, headers = _post(
        f"{server.url}/v2/models/{MODEL}/infer",
        bodies.oip.read_bytes(),
        {
            "Content-Type": "application/octet-stream",
            HEADER_LENGTH: str(bodies.oip_header_length),
        },
    )
    split = int(headers[HEADER_LENGTH])
    got = np.frombuffer(body[split:], "<f4")
    found["rest_oip_max_abs_diff"] = _close("REST OIP binary", got, bodies.expected)

    before = settled_counts(server)
    load = run_h2load(
        f"http://{server.grpc_address}{SERVICE}/ModelInfer",
        32,
        1,
        bodies.grpc_infer,
        GRPC_HEADERS,
        threads=opts.h2load_threads,
        requests=CHECK_REQUESTS,
    )
    counted = _delta(settled_counts(server), before)
    found["h2load_count_run"] = {
        "requests": CHECK_REQUESTS,
        "h2load_answered": load.requests,
        "h2load_errors": load.errors,
        "server_counted": {f"{p} {s}": n for (p, s), n in counted.items()},
    }
    all_ok = {("grpc", "200"): CHECK_REQUESTS}
    if load.requests != CHECK_REQUESTS or load.errors or counted != all_ok:
        raise SystemExit(f"the h2load check run was not all gRPC successes: {found}")
    for mode in CPP_MODES:
        before = settled_counts(server)
        cpp = run_grpc_loadgen(
            server.grpc_address,
            mode,
            32,
            bodies.grpc_message,
            requests=CHECK_REQUESTS,
            threads=opts.cpp_threads,
        )
        counted = _delta(settled_counts(server), before)
        found[f"grpc_loadgen_{mode}_count_run"] = {
            "requests": CHECK_REQUESTS,
            "answered": cpp.requests,
            "errors": cpp.errors,
            "server_counted": {f"{p} {s}": n for (p, s), n in counted.items()},
        }
        if cpp.requests != CHECK_REQUESTS or cpp.errors or counted != all_ok:
            raise SystemExit(
                f"the grpc_loadgen {mode} check run was not all gRPC successes: {found}"
            )
    return found


# -- loads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    key: str
    label: str
    client: str
    """The load generator: wrk, h2load or C++ (grpc_loadgen)."""
    connections: int
    streams: int
    protocol: str | None
    """The server's request count checked against the client's ("rest", "grpc"), or None."""
    run: LoadFn
    """Load for the given seconds."""


def loads(server: ServerProcess, bodies: Bodies, opts: Options) -> tuple[list[Load], list[Load]]:
    """(the measured loads, the trivial ones that show the load generators' headroom)."""
    grpc_url = f"http://{server.grpc_address}{SERVICE}"
    json_headers = {"Content-Type": "application/json"}
    oip_headers = {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(bodies.oip_header_length),
    }

    def wrk(path: str, body: Path | None, headers: Mapping[str, str]) -> LoadFn:
        return lambda s: run_wrk(server.url + path, 32, s, opts.wrk_threads, body, headers)

    def h2load(method: str, clients: int, streams: int, body: Path) -> LoadFn:
        return lambda s: run_h2load(
            f"{grpc_url}/{method}",
            clients,
            streams,
            body,
            GRPC_HEADERS,
            threads=opts.h2load_threads,
            seconds=s,
        )

    def cpp(mode: str, channels: int = 32) -> LoadFn:
        assert server.grpc_address is not None
        address = server.grpc_address
        return lambda s: run_grpc_loadgen(
            address,
            mode,
            32,
            bodies.grpc_message,
            seconds=s,
            threads=opts.cpp_threads,
            channels=channels,
        )

    infer = "gRPC ModelInfer, raw_input_contents"
    measured = [
        Load("rest_json", f"REST JSON /predictions/{MODEL}", "wrk", 32, 1, "rest",
             wrk(f"/predictions/{MODEL}", bodies.json, json_headers)),
        Load("rest_oip", f"REST OIP binary /v2/models/{MODEL}/infer", "wrk", 32, 1, "rest",
             wrk(f"/v2/models/{MODEL}/infer", bodies.oip, oip_headers)),
        Load("grpc_32x1", infer, "h2load", 32, 1, "grpc",
             h2load("ModelInfer", 32, 1, bodies.grpc_infer)),
        Load("grpc_1x32", infer, "h2load", 1, 32, "grpc",
             h2load("ModelInfer", 1, 32, bodies.grpc_infer)),
        Load("grpc_cpp_unary", infer, "C++", 32, 1, "grpc", cpp("unary")),
        Load("grpc_cpp_stream", "gRPC ModelStreamInfer, raw_input_contents", "C++", 32, 1,
             "grpc", cpp("stream")),
        # One channel multiplexing 32 streams, as a gRPC client usually does; still one message
        # in flight per stream, 32 in all, as with wrk's 32 connections.
        Load("grpc_cpp_stream_1x32", "gRPC ModelStreamInfer, raw_input_contents", "C++", 1, 32,
             "grpc", cpp("stream", channels=1)),
    ]  # fmt: skip
    headroom = [
        Load("rest_live", "REST GET /v2/health/live", "wrk", 32, 1, None,
             wrk("/v2/health/live", None, {})),
        Load("grpc_live", "gRPC ServerLive", "h2load", 32, 1, None,
             h2load("ServerLive", 32, 1, bodies.grpc_live)),
    ]  # fmt: skip
    return measured, headroom


@dataclass(frozen=True)
class Measured:
    run: Run
    server_ok: int | None
    """Answers the server counted as 200 for the load's protocol over the run."""

    @property
    def unseen(self) -> int | None:
        """Server 200s the client did not count: answers in flight when the client stopped."""
        load = self.run.load
        return None if self.server_ok is None else self.server_ok - (load.requests - load.errors)

    @property
    def cpu_us_per_request(self) -> float:
        """The server's CPU time per answered request, all its threads together."""
        return self.run.server_cpu / self.run.load.rps * 1e6 if self.run.load.rps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.run.to_dict(),
            "server_cpu_us_per_request": round(self.cpu_us_per_request, 1),
            "server_ok": self.server_ok,
            "unseen": self.unseen,
        }


def measure(server: ServerProcess, load: Load, opts: Options) -> Measured:
    """Warm up, then one measured run, with the server's CPU, batch sizes and counts over it."""
    load.run(opts.warmup)
    counts = settled_counts(server)
    cpu = server.cpu_seconds()
    requests, batches = server.batch_counts()
    started = time.monotonic()
    result = load.run(opts.seconds)
    cpu = (server.cpu_seconds() - cpu) / (time.monotonic() - started)
    requests_after, batches_after = server.batch_counts()
    ran = batches_after - batches
    counted = _delta(settled_counts(server), counts)
    ok = counted.get((load.protocol, "200"), 0) if load.protocol else None
    return Measured(Run(result, cpu, (requests_after - requests) / ran if ran else None), ok)


@dataclass
class Results:
    load_average: list[float] = field(default_factory=list)
    """The machine's 1-minute load average at the start of each round."""
    runs: dict[str, list[Measured]] = field(default_factory=dict)
    """load -> one Measured per round."""
    ratios: dict[str, list[float]] = field(default_factory=dict)
    """"<gRPC load> / <REST load>" -> req/s ratio per round."""


def run_rounds(
    server: ServerProcess, measured: list[Load], headroom: list[Load], opts: Options
) -> Results:
    results = Results()
    for round_ in range(opts.repeats):
        results.load_average.append(os.getloadavg()[0])
        print(
            f"  round {round_ + 1}/{opts.repeats} (load average {results.load_average[-1]:.1f})",
            flush=True,
        )
        # The measured loads' order turns each round, so no protocol always runs first.
        turn = round_ % len(measured)
        for load in headroom + measured[turn:] + measured[:turn]:
            results.runs.setdefault(load.key, []).append(measure(server, load, opts))
        for g in GRPC_RATIOS:
            for r in ("rest_json", "rest_oip"):
                ratio = results.runs[g][-1].run.load.rps / results.runs[r][-1].run.load.rps
                results.ratios.setdefault(f"{g} / {r}", []).append(ratio)
    return results


# -- report --------------------------------------------------------------------------------
GRPC_RATIOS = {
    "grpc_32x1": "32 x 1",
    "grpc_1x32": "1 x 32",
    "grpc_cpp_unary": "ModelInfer C++ 32 x 1",
    "grpc_cpp_stream": "ModelStreamInfer C++ 32 x 1",
    "grpc_cpp_stream_1x32": "ModelStreamInfer C++ 1 x 32",
}
"""The gRPC loads whose req/s are compared with REST's: load key -> label in the ratio lines."""
_HEADER = (
    f"{'load':<42}{'client':>7}{'conns x streams':>16}{'req/s':>7}{'p50 ms':>7}{'p90 ms':>7}"
    f"{'p99 ms':>7}{'errors':>7}{'srv CPU':>8}{'µs/req':>7}{'cli CPU':>8}{'batch':>6}"
    f"{'unseen':>7}"
)


def _row(load: Load, runs: Sequence[Measured]) -> str:
    results = [m.run.load for m in runs]
    batches = [m.run.mean_batch for m in runs if m.run.mean_batch is not None]
    unseen = [m.unseen for m in runs if m.unseen is not None]
    return (
        f"{load.label:<42}{load.client:>7}{f'{load.connections} x {load.streams}':>16}"
        f"{median([r.rps for r in results]):>7.0f}{median([r.p50_ms for r in results]):>7.2f}"
        f"{median([r.p90_ms for r in results]):>7.2f}{median([r.p99_ms for r in results]):>7.2f}"
        f"{sum(r.errors for r in results):>7}{median([m.run.server_cpu for m in runs]):>8.2f}"
        f"{median([m.cpu_us_per_request for m in runs]):>7.0f}"
        f"{median([r.client_cpu for r in results]):>8.2f}"
        + (f"{median(batches):>6.1f}" if batches else f"{'-':>6}")
        + (f"{max(unseen):>7}" if unseen else f"{'-':>7}")
    )


def _rounds(values: Sequence[float]) -> str:
    return " (rounds: " + " ".join(f"{v:.2f}" for v in values) + ")" if len(values) > 1 else ""


def table(measured: list[Load], headroom: list[Load], opts: Options, results: Results) -> str:
    rounds = len(results.load_average)
    lines = [
        f"Scenario A over REST and gRPC: MLP 512-1024-1024-10, one row per request, batching on "
        f"(max batch {opts.max_batch_size}), median of {rounds} round{'s' * (rounds > 1)}",
        _HEADER,
        *(_row(load, results.runs[load.key]) for load in measured),
    ]
    trivial = []
    for load in headroom:
        runs = [m.run.load for m in results.runs[load.key]]
        trivial.append(
            f"{load.label} ({load.client}) {median([r.rps for r in runs]):.0f} req/s "
            f"(cli CPU {median([r.client_cpu for r in runs]):.2f})"
        )
    lines.append("headroom, trivial requests at 32 connections: " + ", ".join(trivial))
    names = {"rest_json": "REST JSON", "rest_oip": "REST OIP binary"}
    for g, label in GRPC_RATIOS.items():
        parts = [
            f"/ {names[r]} {median(results.ratios[f'{g} / {r}']):.2f}"
            f"{_rounds(results.ratios[f'{g} / {r}'])}"
            for r in names
        ]
        met = all(median(results.ratios[f"{g} / {r}"]) >= 1.0 for r in names)
        lines.append(
            f"req/s gRPC {label} {', '.join(parts)}  "
            f"[target gRPC >= REST: {'met' if met else 'missed'}]"
        )
    lines.append(_checks(measured, results))
    return "\n".join(lines) + "\n"


def _checks(measured: Sequence[Load], results: Results) -> str:
    """Per run: the server counted every answer the client counted, plus at most one per
    stream in flight when the client stopped."""
    off = [
        f"{load.key} round {i + 1}: {m.unseen}"
        for load in measured
        for i, m in enumerate(results.runs[load.key])
        if m.unseen is None or not 0 <= m.unseen <= load.connections * load.streams
    ]
    verdict = "every run" if not off else "NOT every run (" + ", ".join(off) + ")"
    # grpc_loadgen waits for every request it sent: the server's 200s are all its successes.
    inexact = [
        f"{load.key} round {i + 1}: server {m.server_ok}, client {m.run.load.total_ok}"
        for load in measured
        for i, m in enumerate(results.runs[load.key])
        if isinstance(m.run.load, GrpcLoadResult) and m.server_ok != m.run.load.total_ok
    ]
    exact = "every run" if not inexact else "NOT every run (" + ", ".join(inexact) + ")"
    return (
        f"server's 200s = client's successes + 0..(connections x streams) in flight at the stop: "
        f"{verdict}\n"
        f"C++ client: server's 200s = all the client's successes (warm-up and drain included): "
        f"{exact}"
    )


def verification_line(found: Mapping[str, Any]) -> str:
    run = found["h2load_count_run"]
    diff = max(v for k, v in found.items() if k.endswith("max_abs_diff"))
    cpp = "; ".join(
        f"grpc_loadgen {mode} --requests {r['requests']}: {r['answered']} answered, "
        f"{r['errors']} errors, server counted {r['server_counted']}"
        for mode in CPP_MODES
        for r in [found[f"grpc_loadgen_{mode}_count_run"]]
    )
    return (
        f"checked before loading: gRPC ModelInfer and ModelStreamInfer (grpcio, the h2load and "
        f"grpc_loadgen bytes), REST /predictions and OIP binary answer the model's output (max abs "
        f"diff {diff:.1e}); h2load -n {run['requests']}: {run['h2load_answered']} answered, "
        f"{run['h2load_errors']} errors, server counted {run['server_counted']}; {cpp}"
    )


# -- command -------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.grpc_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="3 s runs, 1 s warm-up, 1 round")
    p.add_argument("--seconds", type=float, help="length of each measured run (default 10)")
    p.add_argument("--warmup", type=float, help="warm-up before each run (default 2)")
    p.add_argument("--repeats", type=int, help="rounds (default 3)")
    p.add_argument("--wrk-threads", type=int, default=2, help="wrk threads (default 2)")
    p.add_argument("--h2load-threads", type=int, default=1, help="h2load threads (default 1)")
    p.add_argument(
        "--cpp-threads", type=int, default=1, help="grpc_loadgen (C++ client) threads (default 1)"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="scriptserve workers (default: the CPU count)",
    )
    p.add_argument("--intra-op-threads", type=int, default=1, help="torch threads per model call")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=32,
        help="scriptserve's batch limit (default 32; 1 = batching off)",
    )
    p.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wrk_path()
    h2load_path()
    grpc_loadgen_path()
    opts = Options(
        seconds=args.seconds or (3.0 if args.quick else 10.0),
        warmup=args.warmup or (1.0 if args.quick else 2.0),
        repeats=args.repeats or (1 if args.quick else 3),
        wrk_threads=args.wrk_threads,
        h2load_threads=args.h2load_threads,
        cpp_threads=args.cpp_threads,
        workers=args.workers,
        intra_op_threads=args.intra_op_threads,
        max_batch_size=args.max_batch_size,
    )
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    print(f"grpc_load: {opts}", flush=True)
    with tempfile.TemporaryDirectory(prefix="scriptserve-bench-") as tmp:
        model = build(MODEL, Path(tmp), Path(tmp) / "store")
        bodies = write_bodies(model, Path(tmp))
        with scriptserve(
            "scriptserve",
            model.archive.parent,
            MODEL,
            opts.workers,
            opts.intra_op_threads,
            opts.max_batch_size,
        ) as server:
            found = verify(server, bodies, opts)
            print("  " + verification_line(found), flush=True)
            measured, headroom = loads(server, bodies, opts)
            results = run_rounds(server, measured, headroom, opts)
            printed = table(measured, headroom, opts, results)
        host = report.host(load_before)
        document = {
            "benchmark": "grpc_load",
            "started": started.isoformat(timespec="seconds"),
            "options": asdict(opts),
            "host": host,
            "body_bytes": {
                "rest_json": bodies.json.stat().st_size,
                "rest_oip": bodies.oip.stat().st_size,
                "grpc_frame": bodies.grpc_infer.stat().st_size,
                "grpc_message": bodies.grpc_message.stat().st_size,
            },
            "verification": found,
            "load_average_per_round": results.load_average,
            "runs": {k: [m.to_dict() for m in v] for k, v in results.runs.items()},
            "ratios": results.ratios,
        }
    print()
    print(printed)
    print(report.host_line(host))
    suffix = "-quick" if args.quick else ""
    out = args.output or RESULTS / f"grpc_load-{started:%Y-%m-%dT%H%M%S}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.compact_json(document))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
