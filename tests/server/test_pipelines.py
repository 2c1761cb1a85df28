"""Ensembles over the Open Inference Protocol (server/models/pipelines.py): pipeline files served
as models over REST (JSON and binary) and gRPC, with metadata from their steps' signatures,
ready only when every step is, steps batched with each other's requests, and failures that name
the step. Real TorchScript archives, a real server, tritonclient and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from otlp import GrpcReceiver
from serving import ServerProcess
from torch import nn

from benchmarks.models import build_holders
from scriptserve.archiver.cli import model_archiver_main

# Slow: a server with three models.
pytestmark = pytest.mark.slow

CHAIN = """
steps:
  - model: double
    inputs: {x: image}
    outputs: {output0: doubled}
  - model: plus_one
    inputs: {x: doubled}
    outputs: {output0: answer}
"""

FORK = """
steps:
  - model: double
    inputs: {x: image}
    outputs: {output0: twice}
  - model: plus_one
    inputs: {x: image}
    outputs: {output0: more}
outputs: [twice, more]
"""

ROW = np.arange(8, dtype=np.float32).reshape(1, 8)


class Affine(nn.Module):
    def __init__(self, scale: float, shift: float) -> None:
        super().__init__()
        self.scale = scale
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipelines")
    store, work = root / "store", root / "work"
    work.mkdir()
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    for name, scale, shift in (("double", 2.0, 0.0), ("plus_one", 1.0, 1.0)):
        path = work / f"{name}.pt"
        torch.jit.script(Affine(scale, shift)).save(str(path))
        argv = ["--model-name", name, "--version", "1.0", "--serialized-file", str(path)]
        argv += ["--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store)]
        assert model_archiver_main(argv) == 0
    (store / "chain.pipeline.yaml").write_text(CHAIN)
    (root / "fork.pipeline.yaml").write_text(FORK)  # registered by a test, from the store
    return store


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        store, "--enable-model-api", "--workers", "1", "--max-batch-delay", "20", "--no-snapshot"
    ).start()
    (store / "fork.pipeline.yaml").write_text(FORK)
    with httpx.Client(timeout=60, headers=proc.mgmt_headers) as client:
        registered = client.post(f"{proc.mgmt}/models", params={"url": "fork.pipeline.yaml"})
        assert registered.status_code == 200, registered.text
        assert registered.json() == {"status": 'Pipeline "fork" registered: double -> plus_one'}
    yield proc
    proc.stop()


def body(row: np.ndarray, name: str = "image") -> dict[str, object]:
    return {
        "inputs": [
            {
                "name": name,
                "shape": list(row.shape),
                "datatype": "FP32",
                "data": row.ravel().tolist(),
            }
        ]
    }


def test_a_pipeline_is_a_model_with_its_steps_metadata(server: ServerProcess) -> None:
    answer = httpx.post(f"{server.url}/v2/models/chain/infer", json=body(ROW), timeout=30)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert out["model_name"] == "chain" and out["model_version"] == "1"
    assert out["outputs"] == [
        {
            "name": "answer",
            "datatype": "FP32",
            "shape": [1, 8],
            "data": (2 * ROW + 1).ravel().tolist(),
        }
    ]
    meta = httpx.get(f"{server.url}/v2/models/chain").json()
    assert meta["platform"] == "ensemble" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 8]}]
    assert meta["outputs"] == [{"name": "answer", "datatype": "FP32", "shape": [-1, 8]}]
    assert httpx.get(f"{server.url}/v2/models/chain/ready").status_code == 200


def test_independent_steps_answer_over_grpc_and_binary_rest(server: ServerProcess) -> None:
    image = triton_grpc.InferInput("image", [1, 8], "FP32")
    image.set_data_from_numpy(ROW)
    with triton_grpc.InferenceServerClient(server.grpc) as client:
        result = client.infer("fork", [image])
        assert np.array_equal(result.as_numpy("twice"), 2 * ROW)
        assert np.array_equal(result.as_numpy("more"), ROW + 1)
        assert client.is_model_ready("fork")
        assert client.get_model_metadata("fork").platform == "ensemble"
    binary = triton_http.InferInput("image", [1, 8], "FP32")
    binary.set_data_from_numpy(ROW, binary_data=True)
    wanted = [triton_http.InferRequestedOutput("more", binary_data=True)]
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    result = client.infer("fork", [binary], outputs=wanted)
    assert np.array_equal(result.as_numpy("more"), ROW + 1) and result.as_numpy("twice") is None


def test_concurrent_pipeline_requests_batch_at_each_step(server: ServerProcess) -> None:
    rows = [np.full((1, 8), i, np.float32) for i in range(32)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            url = f"{server.url}/v2/models/chain/infer"
            return await asyncio.gather(*(client.post(url, json=body(r)) for r in rows))

    for row, answer in zip(rows, asyncio.run(burst()), strict=True):
        assert answer.json()["outputs"][0]["data"] == (2 * row + 1).ravel().tolist()
    text = httpx.get(f"{server.metrics_url}/metrics").text
    found = dict(
        re.findall(
            r'^scriptserve_batch_size_(sum|count)\{model="plus_one",version="1.0"\} (\S+)$',
            text,
            re.MULTILINE,
        )
    )
    assert float(found["sum"]) / float(found["count"]) > 1.0
    chain = 'scriptserve_requests_total{model="chain",protocol="rest",status="200",version="1"}'
    steps = 'scriptserve_requests_total{model="plus_one",protocol="pipeline",status="200"'
    assert chain in text and steps in text  # the pipeline's requests, and its steps' as such


def test_a_failing_step_fails_its_request_alone_and_names_the_step(
    server: ServerProcess,
) -> None:
    wrong = httpx.post(
        f"{server.url}/v2/models/chain/infer", json=body(np.zeros((1, 4), np.float32)), timeout=30
    )
    assert wrong.status_code == 400, wrong.text
    assert "pipeline 'chain' step 'double'" in wrong.json()["error"]
    missing = httpx.post(f"{server.url}/v2/models/chain/infer", json=body(ROW, "x"), timeout=30)
    assert missing.status_code == 400 and "needs input 'image'" in missing.json()["error"]
    assert httpx.post(f"{server.url}/v2/models/chain/infer", json=body(ROW)).status_code == 200


def test_a_step_that_cannot_serve_makes_the_pipeline_unready_not_broken(
    server: ServerProcess,
) -> None:
    with httpx.Client(timeout=60, headers=server.mgmt_headers) as client:
        scaled = client.put(
            f"{server.mgmt}/models/plus_one", params={"min_worker": 0, "synchronous": "true"}
        )
        assert scaled.status_code == 200, scaled.text
        try:
            assert httpx.get(f"{server.url}/v2/models/chain/ready").status_code != 200
            refused = httpx.post(f"{server.url}/v2/models/chain/infer", json=body(ROW))
            assert refused.status_code == 503 and "step 'plus_one'" in refused.json()["error"]
        finally:
            client.put(
                f"{server.mgmt}/models/plus_one", params={"min_worker": 1, "synchronous": "true"}
            )
        assert httpx.get(f"{server.url}/v2/models/chain/ready").status_code == 200
        listed = client.get(f"{server.mgmt}/models").json()["models"]
        assert {"modelName": "fork", "modelUrl": "fork.pipeline.yaml"} in listed
        described = client.get(f"{server.mgmt}/models/fork").json()[0]["pipeline"]
        assert described["outputs"] == ["twice", "more"] and len(described["steps"]) == 2
        again = client.post(
            f"{server.mgmt}/models", params={"url": "fork.pipeline.yaml", "model_name": "fork2"}
        )
        assert again.status_code == 200, again.text
        gone = client.delete(f"{server.mgmt}/models/fork2")
        assert gone.status_code == 200 and "unregistered" in gone.text
        assert httpx.get(f"{server.url}/v2/models/fork2/ready").status_code == 404


def test_a_pipeline_request_is_one_access_line_and_one_span_tree(
    store: Path, tmp_path: Path
) -> None:
    """The access line and the server span name the pipeline (its steps do not replace it),
    and each step's queue and batch are children of that span."""
    receiver = GrpcReceiver()
    access = tmp_path / "access.log"
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--no-snapshot",
        "--access-log",
        str(access),
        "--access-log-format",
        "json",
        "--tracing",
        "--tracing-endpoint",
        receiver.endpoint,
        "--tracing-protocol",
        "grpc",
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},
    ).start()
    try:
        trace_id = secrets.token_hex(16)
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01", "X-Request-Id": "p1"}
        answer = httpx.post(
            f"{proc.url}/v2/models/chain/infer", json=body(ROW), headers=headers, timeout=30
        )
        assert answer.status_code == 200, answer.text
        spans = receiver.wait_for(
            lambda all_: sum(s.trace_id == trace_id and s.name == "batch" for s in all_) >= 2
        )
    finally:
        proc.stop()
        receiver.stop()
    mine = [s for s in spans if s.trace_id == trace_id]
    (root,) = [s for s in mine if s.kind == "SERVER"]
    assert root.attributes["scriptserve.model.name"] == "chain"
    assert root.attributes["scriptserve.model.version"] == "1"
    batches = [s for s in mine if s.name == "batch"]
    assert len(batches) == 2 and all(s.parent_id == root.span_id for s in batches)
    steps = [s for s in mine if s.name in ("queue", "batch")]  # each names its step's model
    assert sorted(s.attributes["scriptserve.model.name"] for s in steps) == [
        "double",
        "double",
        "plus_one",
        "plus_one",
    ]
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    (line,) = [entry for entry in lines if entry.get("request_id") == "p1"]
    assert (line["model"], line["version"], line["status"]) == ("chain", "1", 200)


def test_the_clients_deadline_covers_the_whole_pipeline(server: ServerProcess) -> None:
    late = httpx.post(
        f"{server.url}/v2/models/chain/infer",
        json=body(ROW),
        headers={"X-Request-Timeout": "0.000001"},
        timeout=30,
    )
    assert late.status_code == 504, late.text
    assert "pipeline 'chain'" in late.json()["error"]


def test_independent_steps_run_at_once(tmp_path: Path) -> None:
    """Two steps that each take about half a second: the pipeline answers in well under their
    sum. Each time is the best of a few calls, so that a moment when other work holds one of
    the two cores does not decide it; steps run one after the other never answer under their
    sum, however many times they are tried."""
    store = build_holders(tmp_path, [1, 1], prefix="slow", busy=2000)
    (store / "both.pipeline.yaml").write_text(
        "steps:\n"
        "  - {model: slow0, inputs: {x: image}, outputs: {output0: a}}\n"
        "  - {model: slow1, inputs: {x: image}, outputs: {output0: b}}\n"
    )
    proc = ServerProcess(store, "--workers", "1", "--no-snapshot", "--no-warmup").start()

    def best_of(calls: int, name: str, payload: dict[str, object]) -> tuple[float, httpx.Response]:
        times, reply = [], None
        for _ in range(calls):
            started = time.perf_counter()
            reply = httpx.post(f"{proc.url}/v2/models/{name}/infer", json=payload, timeout=30)
            assert reply.status_code == 200, reply.text
            times.append(time.perf_counter() - started)
        assert reply is not None
        return min(times), reply

    try:
        one = []
        for name in ("slow0", "slow1"):
            best_of(1, name, body(ROW, "x"))  # warms the model up
            one.append(best_of(2, name, body(ROW, "x"))[0])
        took, both = best_of(3, "both", body(ROW))
    finally:
        proc.stop()
    assert [o["name"] for o in both.json()["outputs"]] == ["a", "b"]
    assert took < 0.8 * sum(one), (took, one)  # not one after the other
