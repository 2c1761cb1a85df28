"""The model the gpu check measures (an MLP, its source written for the archiver), its answers
on the CPU, and the clients that measure it: in-process, over REST and over gRPC."""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.plan import CLASSES, FEATURES, HIDDEN, WORK

MODEL_FILE = f"""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear({FEATURES}, {HIDDEN}), nn.ReLU(), nn.Linear({HIDDEN}, {HIDDEN}), nn.ReLU(),
            nn.Linear({HIDDEN}, {CLASSES}),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
"""


def load_model(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check_mlp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MLP().eval()


def reference(rows: Any) -> Any:
    import torch

    model = load_model(WORK / "src" / "mlp.py")
    with torch.no_grad():
        return model(torch.from_numpy(rows)).numpy()


def oip_body(row: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "shape": [1, FEATURES], "datatype": "FP32", "data": row.tolist()}]
    }


async def rest_answers(url: str, model: str, rows: Any) -> Any:
    import httpx
    import numpy as np

    async with httpx.AsyncClient(timeout=60) as client:
        posts = [client.post(f"{url}/v2/models/{model}/infer", json=oip_body(r)) for r in rows]
        answers = await asyncio.gather(*posts)
    for answer in answers:
        answer.raise_for_status()
    return np.array([a.json()["outputs"][0]["data"] for a in answers], dtype=np.float32)


def grpc_request(model: str, rows: Any) -> Any:
    from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(rows.tobytes())
    return request


def grpc_answers(address: str, model: str, rows: Any) -> Any:
    import grpc
    import numpy as np

    from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as rpc

    with grpc.insecure_channel(address) as channel:
        stub = rpc.GRPCInferenceServiceStub(channel)
        with ThreadPoolExecutor(64) as pool:
            calls = [stub.ModelInfer.future(grpc_request(model, r[None]), timeout=60) for r in rows]
            replies = list(pool.map(lambda c: c.result(), calls))
    return np.stack([np.frombuffer(r.raw_output_contents[0], np.float32) for r in replies])


def timed_calls(backend: Any, x: Any, seconds: float) -> dict[str, float]:
    """Median seconds per call over `seconds` of calls (after 3 warm ones), and items/s."""
    for _ in range(3):
        backend.run({"x": x})
    times: list[float] = []
    until = time.perf_counter() + seconds
    while time.perf_counter() < until or len(times) < 5:
        started = time.perf_counter()
        backend.run({"x": x})
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"median_ms": round(median * 1e3, 3), "items_per_s": round(len(x) / median, 1)}


def served_items(address: str, model: str, batch: int, seconds: float) -> float:
    """Items per second answered to 4 gRPC clients sending `batch` rows per request: each
    client's rate over the same `seconds`, begun once every client has a warm connection (a
    first call that outlasts a short window must not leave it empty), and at least one call
    each."""
    import grpc
    import numpy as np

    from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as rpc

    rows = np.random.default_rng(2).standard_normal((batch, FEATURES)).astype(np.float32)
    request = grpc_request(model, rows)
    clients = 4
    warm = threading.Barrier(clients)

    def client(_: int) -> float:
        with grpc.insecure_channel(address) as channel:
            stub = rpc.GRPCInferenceServiceStub(channel)
            stub.ModelInfer(request, timeout=60)  # a warm connection before the clock
            warm.wait(timeout=120)
            started, done = time.perf_counter(), 0
            while True:
                stub.ModelInfer(request, timeout=60)
                done += batch
                elapsed = time.perf_counter() - started
                if elapsed >= seconds:
                    return done / elapsed

    with ThreadPoolExecutor(clients) as pool:
        return round(sum(pool.map(client, range(clients))), 1)


def onnx_cuda_note() -> str:
    if importlib.util.find_spec("onnxruntime") is None:
        return "not measured: onnxruntime is not installed"
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return (
            "not measured: this onnxruntime is the CPU build (onnxruntime-gpu, the gpu extra, "
            "is larger than what may travel to the machine)"
        )
    return "not measured: ONNX export is not part of this check yet"
