"""Requests per second with thread workers vs process workers, 2 workers each, over REST.

Two models: the TinyMLP through the built-in `tensor` handler (the model call releases the GIL,
so threads already use both cores and processes only add the shared-memory hand-over), and a
Python-heavy handler (pure-Python work per request, holding the GIL: two threads share one core,
two processes use two).

    python -m benchmarks.process_workers            # 10 s per measurement, median of 3
    python -m benchmarks.process_workers --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

from benchmarks.servers import scriptserve
from scriptserve.archiver.cli import model_archiver_main

# After the packages are imported: the folder tests/archiver would shadow the archiver package.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from testmodels import save_torchscript

PYTHON_HEAVY_HANDLER = """
import numpy as np

from scriptserve.handlers.base import InferenceResponse
from scriptserve.handlers.tensor import TensorHandler


class PythonHeavy(TensorHandler):
    supports_batching = False

    def handle(self, requests, context):
        total = 0
        for i in range({loops}):  # tokenizer-like pure-Python work, GIL held throughout
            total += i % 7
        return [InferenceResponse(outputs={{"y": np.array([[total]])}}) for _ in requests]
"""
BODY = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}


def build_store(root: Path, loops: int) -> Path:
    store = root / "store"
    model = save_torchscript(root / "tiny.pt")
    sample = root / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    handler = root / "python_heavy.py"
    handler.write_text(textwrap.dedent(PYTHON_HEAVY_HANDLER.format(loops=loops)))
    for name, handler_arg in (("tiny", "tensor"), ("pyheavy", str(handler))):
        argv = [
            "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
            "--handler", handler_arg, "--sample-input", str(sample), "--export-path", str(store),
        ]  # fmt: skip
        assert model_archiver_main(argv) == 0
    return store


async def _load(url: str, concurrency: int, seconds: float) -> int:
    done = 0
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=60) as client:

        async def one() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                response = await client.post(url, json=BODY)
                response.raise_for_status()
                done += 1

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return done


def measure(url: str, concurrency: int, seconds: float, repeats: int) -> float:
    asyncio.run(_load(url, concurrency, min(2.0, seconds)))  # warm-up
    rates = [asyncio.run(_load(url, concurrency, seconds)) / seconds for _ in range(repeats)]
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--loops", type=int, default=300_000, help="Python work per request")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.repeats = 2.0, 1

    results: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = build_store(Path(tmp), args.loops)
        for mode in ("thread", "process"):
            server = scriptserve(f"{mode} workers", store, "tiny", 2, 1, 32)  # tiny loads last
            server.env = {"SCRIPTSERVE_WORKER_MODE": mode}
            with server:
                for model in ("tiny", "pyheavy"):
                    url = f"{server.url}/v2/models/{model}/infer"
                    rate = measure(url, args.concurrency, args.seconds, args.repeats)
                    results[(mode, model)] = rate
                    print(f"{mode:8s} {model:8s} {rate:9.1f} req/s", flush=True)

    print()
    print(f"{'model':10s} {'thread':>10s} {'process':>10s} {'process/thread':>15s}")
    for model in ("tiny", "pyheavy"):
        thread, process = results[("thread", model)], results[("process", model)]
        print(f"{model:10s} {thread:10.1f} {process:10.1f} {process / thread:14.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
