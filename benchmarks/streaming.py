"""Streamed answers: time to the first part and parts per second, 1 and 32 streams at once.

    python -m benchmarks.streaming [--quick] [--rounds 3] [--seconds 8] [--tokens 64]

The model is the streaming demo's (scripts/textgen_model.py: a next-byte model compiled to a
`.pt2` archive, served by the builtin `text_generator` handler, one part per token). One
worker with one intra-op thread, batches of up to 32 with no delay (the scenarios' settings on
this machine's other core). Each client loops: open a stream asking for `--tokens` tokens, read
it to its end, open the next; `--concurrency` such clients run at once for `--seconds`.

Three ways to take a stream: Triton's `/v2/models/textgen/generate_stream` (Server-Sent
Events), TorchServe's `/predictions/textgen` (HTTP chunks), and OIP gRPC `ModelStreamInfer`
(tritonclient's asyncio client, one call per stream). Figures: the median and p99 time to the
first part (request sent -> first part read, the queue and the prompt's first step included),
parts per second over all streams, and the median gap between reads that bring parts. The
clients run on this machine too (one process, asyncio), so at 32 streams they share its two
cores with the server. Medians over rounds; the endpoints take turns within each round.
Writes benchmarks/results/streaming.json.

The handler generates a batch to its end before it takes the next (no joining mid-generation),
so at 32 streams a new stream's first part waits for the batch in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import report
from benchmarks.servers import REPO, ServerProcess, scriptserve
from scriptserve.archiver.cli import model_archiver_main

RESULTS = Path(__file__).resolve().parent / "results" / "streaming.json"
MODEL = "textgen"
PROMPT = "serving a model "
ENDPOINTS = ("generate_stream", "predictions", "grpc_stream")


@dataclass
class Options:
    rounds: int = 3
    seconds: float = 8.0
    tokens: int = 64
    concurrency: tuple[int, ...] = (1, 32)


@dataclass
class Measured:
    """One endpoint at one concurrency for one round."""

    first_part_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)
    parts: int = 0
    streams: int = 0
    errors: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, float]:
        firsts = sorted(self.first_part_ms) or [float("nan")]
        return {
            "streams": self.streams,
            "errors": self.errors,
            "parts_per_s": self.parts / self.seconds if self.seconds else 0.0,
            "first_part_p50_ms": statistics.median(firsts),
            "first_part_p99_ms": firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))],
            "gap_p50_ms": statistics.median(self.gaps_ms) if self.gaps_ms else float("nan"),
        }


Parts = Callable[[], AsyncIterator[int]]
"""Open one stream; yields the number of parts each read brought (HTTP reads may carry
several: a Server-Sent Event ends with a blank line, and each /predictions part of this
model is one byte, its token)."""


def build_archive(store: Path, workdir: Path) -> None:
    """The demo's textgen archive (`make demo-textgen`'s commands) in `store`."""
    subprocess.run([sys.executable, "scripts/textgen_model.py", str(workdir)], cwd=REPO, check=True)
    argv = [
        "--model-name", MODEL, "--version", "1.0", "--export-pt2",
        "--model-file", str(REPO / "scripts" / "textgen_model.py"), "--model-class", "ByteLM",
        "--serialized-file", str(workdir / "textgen-weights.pt"), "--max-batch", "32",
        "--handler", "text_generator", "--sample-input", str(workdir / "textgen-sample.json"),
        "--input-dtype", "INT64", "--export-path", str(store), "-f",
    ]  # fmt: skip
    if model_archiver_main(argv) != 0:
        raise RuntimeError("model-archiver could not build the textgen archive")


def rest_stream(
    client: httpx.AsyncClient, server: ServerProcess, endpoint: str, tokens: int
) -> Parts:
    sse = endpoint == "generate_stream"
    if sse:
        url = f"{server.url}/v2/models/{MODEL}/generate_stream"
        body: dict[str, Any] = {"text_input": PROMPT, "parameters": {"max_tokens": tokens}}
    else:
        url = f"{server.url}/predictions/{MODEL}"
        body = {"text_input": PROMPT, "max_tokens": tokens}

    async def parts() -> AsyncIterator[int]:
        async with client.stream("POST", url, json=body) as answer:
            if answer.status_code != 200:
                raise RuntimeError(f"{endpoint}: {answer.status_code} {await answer.aread()!r}")
            async for data in answer.aiter_raw():
                yield data.count(b"\n\n") if sse else len(data)

    return parts


def grpc_stream(client: Any, tokens: int) -> Parts:
    import tritonclient.grpc.aio as triton

    prompt = triton.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": MODEL, "inputs": [prompt], "parameters": {"max_tokens": tokens}}

    async def parts() -> AsyncIterator[int]:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise RuntimeError(f"grpc_stream: {error}")
            yield 1
            final = result.get_response().parameters["triton_final_response"].bool_param
            if final:
                return

    return parts


async def load(open_stream: Parts, concurrency: int, seconds: float) -> Measured:
    measured = Measured()
    stop = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < stop:
            started = last = time.perf_counter()
            first = True
            try:
                async for count in open_stream():
                    if not count:
                        continue
                    now = time.perf_counter()
                    if first:
                        measured.first_part_ms.append((now - started) * 1e3)
                        first = False
                    else:
                        measured.gaps_ms.append((now - last) * 1e3)
                    last = now
                    measured.parts += count
            except (RuntimeError, httpx.HTTPError):
                measured.errors += 1
            measured.streams += 1

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    measured.seconds = time.perf_counter() - began
    return measured


async def run_round(server: ServerProcess, opts: Options) -> dict[str, dict[str, Measured]]:
    import tritonclient.grpc.aio as triton

    results: dict[str, dict[str, Measured]] = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    assert server.grpc_address is not None
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        grpc_client = triton.InferenceServerClient(server.grpc_address)
        try:
            for concurrency in opts.concurrency:
                row = results.setdefault(str(concurrency), {})
                for endpoint in ENDPOINTS:
                    if endpoint == "grpc_stream":
                        opener = grpc_stream(grpc_client, opts.tokens)
                    else:
                        opener = rest_stream(http, server, endpoint, opts.tokens)
                    row[endpoint] = await load(opener, concurrency, opts.seconds)
        finally:
            await grpc_client.close()
    return results


def medians(rounds: list[dict[str, dict[str, Measured]]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for concurrency, row in rounds[0].items():
        for endpoint in row:
            summaries = [r[concurrency][endpoint].summary() for r in rounds]
            out.setdefault(concurrency, {})[endpoint] = {
                key: statistics.median(s[key] for s in summaries) for key in summaries[0]
            }
    return out


def table(figures: dict[str, dict[str, dict[str, float]]], tokens: int) -> str:
    lines = [
        f"streams of {tokens} tokens from `{MODEL}` (.pt2, text_generator); medians over rounds",
        f"{'streams':>7}  {'endpoint':<16} {'parts/s':>9} {'first part p50':>15} "
        f"{'p99':>9} {'gap p50':>9} {'errors':>6}",
    ]
    for concurrency, row in figures.items():
        for endpoint, f in row.items():
            lines.append(
                f"{concurrency:>7}  {endpoint:<16} {f['parts_per_s']:>9.0f} "
                f"{f['first_part_p50_ms']:>12.1f} ms {f['first_part_p99_ms']:>6.1f} ms "
                f"{f['gap_p50_ms']:>6.2f} ms {f['errors']:>6.0f}"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    opts = Options(args.rounds, args.seconds, args.tokens)
    if args.quick:
        opts = Options(1, 2.0, args.tokens)
    started = datetime.now()
    before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
        store, workdir = Path(tmp) / "store", Path(tmp) / "work"
        build_archive(store, workdir)
        with scriptserve("scriptserve", store, MODEL, 1, 1, 32) as server:
            rounds = [asyncio.run(run_round(server, opts)) for _ in range(opts.rounds)]
    figures = medians(rounds)
    host = report.host(before)
    document = {
        "benchmark": "streaming",
        "started": started.isoformat(timespec="seconds"),
        "options": asdict(opts),
        "host": host,
        "medians": figures,
        "rounds": [{c: {e: m.summary() for e, m in row.items()} for c, row in r.items()}
                   for r in rounds],
    }  # fmt: skip
    print(table(figures, opts.tokens))
    print(report.host_line(host))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report.compact_json(document))
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
