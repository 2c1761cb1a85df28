"""TorchServe archives served unmodified over /predictions, OIP v2 REST and TorchServe's gRPC."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from serving import ServerProcess
from testmodels import reference_output
from torchserve.tsarchives import instance
from tsprotos import torchserve_stubs

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(ts_store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(ts_store, "--workers", "1").start(timeout_s=120)
    yield proc
    proc.stop()


def expected(i: int) -> list[float]:
    return reference_output(np.asarray([instance(i)], dtype=np.float32))[0].tolist()


async def concurrent_predictions(url: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(url, json=instance(i)) for i in range(count)))


@pytest.mark.parametrize("model", ["scores", "function", "entry"])
def test_eight_concurrent_predictions_are_batched(server: ServerProcess, model: str) -> None:
    responses = asyncio.run(concurrent_predictions(f"{server.url}/predictions/{model}", 8))
    assert [r.status_code for r in responses] == [200] * 8, responses[0].text
    bodies = [r.json() for r in responses]
    assert max(b["batch"] for b in bodies) > 1
    for i, body in enumerate(bodies):
        if model == "scores":
            assert np.allclose(body["scores"], expected(i), atol=1e-5)
        elif model == "function":
            assert body["label"] == int(np.argmax(expected(i)))
        else:
            assert body["sum"] == pytest.approx(sum(expected(i)), abs=1e-4)


def test_builtin_base_handler_over_predictions(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/builtin", json=instance(3), timeout=30)
    assert r.status_code == 200
    assert np.allclose(r.json(), expected(3), atol=1e-5)


def test_handler_headers_and_prediction_exception_reach_the_client(server: ServerProcess) -> None:
    ok = httpx.post(
        f"{server.url}/predictions/scores", json=instance(1), headers={"x-echo": "yes"}, timeout=30
    )
    assert ok.headers["x-echoed"] == "yes"
    failed = httpx.post(f"{server.url}/predictions/scores", json="fail", timeout=30)
    assert failed.status_code == 513
    assert "asked to fail" in failed.text


def test_oip_v2_infer_gives_the_handler_the_tensor_as_json(server: ServerProcess) -> None:
    doc = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": instance(2)}]}
    r = httpx.post(f"{server.url}/v2/models/builtin/infer", json=doc, timeout=30)
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    # Python floats, as in TorchServe's KServe v2 envelope: FP64.
    assert (out["name"], out["shape"], out["datatype"]) == ("predict", [1, 3], "FP64")
    assert np.allclose(out["data"], expected(2), atol=1e-5)

    r = httpx.post(f"{server.url}/v2/models/scores/infer", json=doc, timeout=30)
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    assert np.allclose(outputs["scores"]["data"], expected(2), atol=1e-5)
    assert outputs["batch"]["data"] == [1]


def test_torchserve_grpc_predictions_batch_eight(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = torchserve_stubs().ts_grpc.InferenceAPIsServiceStub(channel)
        futures = [
            stub.Predictions.future(
                torchserve_stubs().ts.PredictionsRequest(
                    model_name="scores", input={"data": json.dumps(instance(i)).encode()}
                ),
                timeout=60,
            )
            for i in range(8)
        ]
        bodies = [json.loads(f.result().prediction) for f in futures]
    assert max(b["batch"] for b in bodies) > 1
    for i, body in enumerate(bodies):
        assert np.allclose(body["scores"], expected(i), atol=1e-5)


def test_describe_shows_the_archive_config(server: ServerProcess) -> None:
    r = httpx.get(f"{server.mgmt}/models/scores", headers=server.mgmt_headers, timeout=30)
    assert r.status_code == 200, r.text
    (desc,) = r.json()
    assert (desc["batchSize"], desc["maxBatchDelay"]) == (8, 400)
    assert (desc["minWorkers"], desc["maxWorkers"]) == (1, 2)
