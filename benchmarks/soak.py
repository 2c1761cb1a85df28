"""Soak: mixed valid, invalid and cancelled traffic (REST and gRPC) against a real server.

Prints the server's RSS and open file descriptors (its children included) after warm-up and at
the end, the growth in percent, and how many requests got an answer, were cancelled on purpose,
or were lost (no answer, no deliberate cancel: must be 0). Results go to benchmarks/results/.

    python -m benchmarks.soak --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hardening import archive  # noqa: E402
from serving import ServerProcess  # noqa: E402

from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip  # noqa: E402
from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as oip_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def footprint(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of the process and its children."""
    proc = psutil.Process(pid)
    rss = fds = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            rss += p.memory_info().rss
            fds += p.num_fds()
    return rss, fds


async def traffic(server: ServerProcess, until: float, counts: Counter[str]) -> None:
    rng = random.Random(0)
    body = [0.5] * 8
    async with (
        httpx.AsyncClient(timeout=30) as client,
        grpc.aio.insecure_channel(server.grpc) as channel,
    ):
        stub = oip_grpc.GRPCInferenceServiceStub(channel)

        async def one() -> None:
            kind = rng.random()
            try:
                if kind < 0.35:
                    r = await client.post(f"{server.url}/predictions/tiny", json=body)
                    counts[f"rest {r.status_code}"] += 1
                elif kind < 0.5:
                    r = await client.post(f"{server.url}/predictions/tiny", content=b"{not json")
                    counts[f"rest {r.status_code}"] += 1
                elif kind < 0.6:
                    r = await client.post(f"{server.url}/predictions/nope", json=body)
                    counts[f"rest {r.status_code}"] += 1
                elif kind < 0.7:
                    with contextlib.suppress(httpx.TimeoutException):
                        await client.post(
                            f"{server.url}/predictions/tiny", json=body, timeout=0.0005
                        )
                        counts["rest answered before cancel"] += 1
                        return
                    counts["cancelled"] += 1
                else:
                    request = oip.ModelInferRequest(model_name="tiny" if kind < 0.9 else "nope")
                    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 8])
                    tensor.contents.fp32_contents.extend(body)
                    if kind > 0.95:
                        call = stub.ModelInfer(request, timeout=30)
                        await asyncio.sleep(0)
                        call.cancel()
                        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                            await call
                        counts["cancelled"] += 1
                        return
                    try:
                        await stub.ModelInfer(request, timeout=30)
                        counts["grpc OK"] += 1
                    except grpc.aio.AioRpcError as exc:
                        counts[f"grpc {exc.code().name}"] += 1
            except Exception as exc:  # any other failure is a lost request
                counts[f"lost {type(exc).__name__}"] += 1

        while time.monotonic() < until:
            await asyncio.gather(*(one() for _ in range(16)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before the baseline")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        archive(store, Path(tmp) / "work", "tiny")
        server = ServerProcess(store, "--workers", "1").start()
        try:
            counts: Counter[str] = Counter()
            asyncio.run(traffic(server, time.monotonic() + args.warmup, Counter()))
            assert server.proc is not None
            rss0, fds0 = footprint(server.proc.pid)
            started = time.monotonic()
            asyncio.run(traffic(server, started + args.duration, counts))
            elapsed = time.monotonic() - started
            rss1, fds1 = footprint(server.proc.pid)
            pending = httpx.get(f"{server.mgmt}/models/tiny", headers=server.mgmt_headers)
            queue = pending.json()[0]["jobQueueStatus"]
        finally:
            server.stop()
    lost = sum(v for k, v in counts.items() if k.startswith("lost"))
    result = {
        "duration_s": round(elapsed, 1),
        "requests": sum(counts.values()),
        "counts": dict(sorted(counts.items())),
        "lost": lost,
        "rss_start_mb": round(rss0 / 2**20, 1),
        "rss_end_mb": round(rss1 / 2**20, 1),
        "rss_growth_pct": round(100 * (rss1 - rss0) / rss0, 2),
        "fds_start": fds0,
        "fds_end": fds1,
        "fds_growth_pct": round(100 * (fds1 - fds0) / fds0, 2),
        "queue_at_end": queue,
    }
    for key, value in result.items():
        print(f"{key:>16}: {value}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"soak-{time.strftime('%Y-%m-%dT%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
