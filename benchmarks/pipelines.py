"""A 3-step pipeline served as one TorchServe workflow against the same steps chained by the
client over HTTP.

    python -m benchmarks.pipelines [--seconds 20] [--rounds 2] [--clients 32]

The steps: `decode` (a workflow function: a 32x32 PNG to its pixels), `cnn` (the small VGG-style
CNN of `benchmarks.models`, scenario B's, in a TorchServe handler: pixels to 10 logits) and
`head` (a 10 -> 5 linear classifier: logits to a label). All three are archived with
TorchServe's own tools (torch-model-archiver, torch-workflow-archiver) and registered once, as
the workflow `bench`; its nodes are models of their own (`bench__decode`, `bench__cnn`,
`bench__head`), so the client can chain the very same models itself: three `/predictions`
calls per image, each answer sent back as the next call's body. Both are loaded by the same
clients, one sending a PNG at a time, in alternating rounds on one server.

Prints requests/s and latency percentiles of each, their ratio (target: the workflow at least
1.5x the chained throughput, with a lower p99), and writes benchmarks/results/pipelines-<date>.json
with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import io
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image
from torch import nn

from benchmarks import models, report
from benchmarks.many_models import KEY, server
from benchmarks.servers import REPO

WORK = REPO / "build" / "pipelines"

ROWS_HANDLER = """
import json

import torch
from ts.torch_handler.base_handler import BaseHandler


class {name}(BaseHandler):
    def preprocess(self, data):
        rows = []
        for row in data:
            value = row.get("data") or row.get("body")
            if isinstance(value, (bytes, bytearray)):
                value = json.loads(value)
            rows.append(value)
        return torch.tensor(rows, dtype=torch.float32)

    def postprocess(self, data):
        return {answer}
"""
"""A TorchServe handler of JSON rows (a request's body, or the previous step's answer)."""

CNN_HANDLER = ROWS_HANDLER.format(
    name="Pixels", answer="[json.dumps(row) for row in data.tolist()]"
)
HEAD_HANDLER = ROWS_HANDLER.format(
    name="Label",
    answer='[json.dumps({"label": int(row.argmax()), "scores": row.tolist()}) for row in data]',
)

WORKFLOW_HANDLER = """
import io
import json

import numpy as np
from PIL import Image


def decode(data, context):
    if data is None:
        return data
    answers = []
    for row in data:
        png = row.get("data") or row.get("body")
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), np.float32) / 255.0
        answers.append(json.dumps(pixels.transpose(2, 0, 1).round(4).tolist()))
    return answers
"""

SPEC = """
models:
    min-workers: 1
    max-workers: 1
    batch-size: 8
    max-batch-delay: 5
    retry-attempts: 0
    timeout-ms: 60000

    cnn:
      url: cnn.mar

    head:
      url: head.mar

dag:
  decode: [cnn]
  cnn: [head]
"""


def build() -> Path:
    """The archives under build/pipelines/store, made once."""
    store = WORK / "store"
    if (store / "bench.war").is_file():
        return store
    shutil.rmtree(WORK, ignore_errors=True)
    src = WORK / "src"
    src.mkdir(parents=True)
    store.mkdir()
    torch.manual_seed(0)
    torch.jit.script(models.SmallCNN().eval()).save(str(src / "cnn.pt"))  # type: ignore[no-untyped-call]
    torch.jit.script(nn.Linear(10, 5).eval()).save(str(src / "head.pt"))  # type: ignore[no-untyped-call]
    (src / "cnn_handler.py").write_text(CNN_HANDLER)
    (src / "head_handler.py").write_text(HEAD_HANDLER)
    (src / "workflow_handler.py").write_text(WORKFLOW_HANDLER)
    (src / "bench.yaml").write_text(SPEC)
    for name in ("cnn", "head"):
        _run(
            [
                "torch-model-archiver",
                "--model-name",
                name,
                "--version",
                "1.0",
                "--serialized-file",
                f"{name}.pt",
                "--handler",
                f"{name}_handler.py",
                "--export-path",
                str(store),
            ],
            src,
        )
    _run(
        [
            "torch-workflow-archiver",
            "--workflow-name",
            "bench",
            "--spec-file",
            "bench.yaml",
            "--handler",
            "workflow_handler.py",
            "--export-path",
            str(store),
        ],
        src,
    )
    return store


def _run(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr}")


def png() -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


async def load(url: str, image: bytes, chained: bool, clients: int, seconds: float) -> list[float]:
    """Latencies of the images answered by `clients` closed loops in `seconds`."""
    latencies: list[float] = []

    async def one(http: httpx.AsyncClient) -> None:
        if not chained:
            answer = await http.post(f"{url}/wfpredict/bench", content=image)
            answer.raise_for_status()
            return
        body = image
        for step in ("decode", "cnn", "head"):
            answer = await http.post(f"{url}/predictions/bench__{step}", content=body)
            answer.raise_for_status()
            body = answer.content

    async def client(http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            started = time.perf_counter()
            await one(http)
            latencies.append(time.perf_counter() - started)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await one(http)  # both paths warm
        until = time.monotonic() + seconds
        await asyncio.gather(*(client(http, until) for _ in range(clients)))
    return latencies


def figures(latencies: list[float], seconds: float) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000
    return {
        "requests": len(latencies),
        "throughput_rps": len(latencies) / seconds,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.pipelines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=32)
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    started = dt.datetime.now().astimezone()
    store = build()
    image = png()
    runs: dict[str, list[dict[str, float]]] = {"workflow": [], "chained": []}
    with server("pipelines", store) as process:
        mgmt = process.mgmt_url  # type: ignore[attr-defined]
        headers = {"Authorization": f"Bearer {KEY}"}
        registered = httpx.post(
            f"{mgmt}/workflows", params={"url": "bench.war"}, headers=headers, timeout=120
        )
        registered.raise_for_status()
        for _ in range(args.rounds):
            for label, rounds in runs.items():
                latencies = asyncio.run(
                    load(process.url, image, label == "chained", args.clients, args.seconds)
                )
                rounds.append(figures(latencies, args.seconds))
                print(f"{label}: {json.dumps(report._rounded(rounds[-1]))}", flush=True)
    medians = {
        label: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for label, rounds in runs.items()
    }
    ratio = medians["workflow"]["throughput_rps"] / medians["chained"]["throughput_rps"]
    targets = {
        "throughput_at_least_1.5x": ratio >= 1.5,
        "p99_lower": medians["workflow"]["p99_ms"] < medians["chained"]["p99_ms"],
    }
    print(
        f"workflow {medians['workflow']['throughput_rps']:.0f} req/s against chained "
        f"{medians['chained']['throughput_rps']:.0f} ({ratio:.2f}x); p99 "
        f"{medians['workflow']['p99_ms']:.0f} against {medians['chained']['p99_ms']:.0f} ms"
    )
    host = report.closing(targets, load_before)
    report.write_results(
        "pipelines",
        {
            "benchmark": "pipelines",
            "started": started.isoformat(timespec="seconds"),
            "host": host,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "clients": args.clients,
            "runs": runs,
            "medians": medians,
            "throughput_ratio": ratio,
            "targets": targets,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
