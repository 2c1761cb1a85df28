"""The inference API over HTTP: TorchServe's /ping and /predictions, and Open Inference Protocol v2
(JSON tensors, the binary tensor extension, tritonclient), with its errors, handler failures and
back-pressure."""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from serving import ServerProcess
from testmodels import TinyMLP, reference_output, save_torchscript
from tritonclient.utils import InferenceServerException

from scriptserve.archiver.cli import model_archiver_main

X = (np.arange(24, dtype=np.float32).reshape(3, 8) - 12) / 10
OUTPUT = {"tiny": "output0", "tiny_onnx": "y"}
PLATFORM = {"tiny": "pytorch_torchscript", "tiny_onnx": "onnxruntime_onnx"}
HEADER_LENGTH = "Inference-Header-Content-Length"


def oip_body(x: np.ndarray = X, datatype: str = "FP32", **extra: Any) -> dict[str, Any]:
    tensor = {"name": "x", "shape": list(x.shape), "datatype": datatype, "data": x.tolist()}
    return {"inputs": [tensor], **extra}


def assert_clean(body: str, store: Path) -> None:
    """An error body carries no stack trace and no server filesystem path."""
    assert "Traceback" not in body
    assert str(store) not in body and str(store.parent) not in body
    assert "/tmp/" not in body and "site-packages" not in body


def assert_serves(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/tiny", json=X[0].tolist())
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference_output(X[:1])[0], atol=1e-5)


# -- TorchServe ---------------------------------------------------------------------------------
def test_ping(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/ping")
    assert (r.status_code, r.json()) == (200, {"status": "Healthy"})


@pytest.mark.parametrize("model", ["tiny", "tiny_onnx"])
@pytest.mark.parametrize("route", ["", "/1.0"])
def test_predictions_json_array(server: ServerProcess, model: str, route: str) -> None:
    r = httpx.post(f"{server.url}/predictions/{model}{route}", json=X[1].tolist())
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    np.testing.assert_allclose(r.json(), reference_output(X[1:2])[0], atol=1e-5)


def test_predictions_raw_body(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.url}/predictions/tiny",
        content=json.dumps(X[2].tolist()).encode(),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference_output(X[2:3])[0], atol=1e-5)


def test_predictions_multipart_data_field(server: ServerProcess) -> None:
    files = {"data": ("input.json", json.dumps(X[0].tolist()).encode(), "application/json")}
    r = httpx.post(f"{server.url}/predictions/tiny_onnx", files=files)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference_output(X[:1])[0], atol=1e-5)


# -- OIP: health and metadata -------------------------------------------------------------------
def test_server_metadata_and_health(server: ServerProcess) -> None:
    meta = httpx.get(f"{server.url}/v2").json()
    assert meta["name"] == "scriptserve"
    assert isinstance(meta["version"], str) and meta["version"]
    assert "binary_tensor_data" in meta["extensions"]
    live = httpx.get(f"{server.url}/v2/health/live")
    assert (live.status_code, live.json()) == (200, {"live": True})
    ready = httpx.get(f"{server.url}/v2/health/ready")
    assert (ready.status_code, ready.json()) == (200, {"ready": True})


@pytest.mark.parametrize("model", ["tiny", "tiny_onnx"])
@pytest.mark.parametrize("route", ["", "/versions/1.0"])
def test_model_metadata_and_ready(server: ServerProcess, model: str, route: str) -> None:
    r = httpx.get(f"{server.url}/v2/models/{model}{route}")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "name": model,
        "versions": ["1.0"],
        "platform": PLATFORM[model],
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
        "outputs": [{"name": OUTPUT[model], "datatype": "FP32", "shape": [-1, 3]}],
    }
    ready = httpx.get(f"{server.url}/v2/models/{model}{route}/ready")
    assert (ready.status_code, ready.json()) == (200, {"name": model, "ready": True})


# -- OIP: JSON tensors --------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "tiny_onnx"])
@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_infer_json(server: ServerProcess, model: str, flat: bool) -> None:
    body = oip_body(id="req-42")
    if flat:
        body["inputs"][0]["data"] = X.ravel().tolist()
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["model_name"], doc["model_version"], doc["id"]) == (model, "1.0", "req-42")
    (out,) = doc["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == (OUTPUT[model], "FP32", [3, 3])
    np.testing.assert_allclose(np.reshape(out["data"], (3, 3)), reference_output(X), atol=1e-5)


def test_infer_version_route_and_requested_output(server: ServerProcess) -> None:
    body = oip_body(outputs=[{"name": "y"}])
    r = httpx.post(f"{server.url}/v2/models/tiny_onnx/versions/1.0/infer", json=body)
    assert r.status_code == 200, r.text
    assert "id" not in r.json()
    (out,) = r.json()["outputs"]
    assert out["name"] == "y"
    np.testing.assert_allclose(np.reshape(out["data"], (3, 3)), reference_output(X), atol=1e-5)


# -- OIP: binary tensor extension, by hand ------------------------------------------------------
def binary_request(x: np.ndarray, **params: Any) -> tuple[bytes, dict[str, str]]:
    raw = x.astype("<f4").tobytes()
    header = {
        "id": "bin-1",
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32",
             "parameters": {"binary_data_size": len(raw)}},
        ],
        **params,
    }  # fmt: skip
    head = json.dumps(header).encode()
    headers = {HEADER_LENGTH: str(len(head)), "content-type": "application/octet-stream"}
    return head + raw, headers


def decode_binary(r: httpx.Response) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    split = int(r.headers[HEADER_LENGTH])
    doc = json.loads(r.content[:split])
    arrays, offset = {}, split
    for out in doc["outputs"]:
        size = out["parameters"]["binary_data_size"]
        assert out["datatype"] == "FP32" and "data" not in out
        raw = r.content[offset : offset + size]
        arrays[out["name"]] = np.frombuffer(raw, dtype="<f4").reshape(out["shape"])
        offset += size
    assert offset == len(r.content)
    return doc, arrays


@pytest.mark.parametrize("model", ["tiny", "tiny_onnx"])
def test_infer_binary_in_and_out(server: ServerProcess, model: str) -> None:
    body, headers = binary_request(X, parameters={"binary_data_output": True})
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    doc, arrays = decode_binary(r)
    assert doc["id"] == "bin-1"
    np.testing.assert_allclose(arrays[OUTPUT[model]], reference_output(X), atol=1e-5)


def test_infer_binary_in_json_out(server: ServerProcess) -> None:
    body, headers = binary_request(X, outputs=[{"name": "y", "parameters": {"binary_data": False}}])
    r = httpx.post(f"{server.url}/v2/models/tiny_onnx/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert HEADER_LENGTH not in r.headers
    (out,) = r.json()["outputs"]
    np.testing.assert_allclose(np.reshape(out["data"], (3, 3)), reference_output(X), atol=1e-5)


def test_infer_json_in_binary_out(server: ServerProcess) -> None:
    body = oip_body(outputs=[{"name": "output0", "parameters": {"binary_data": True}}])
    r = httpx.post(f"{server.url}/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    _, arrays = decode_binary(r)
    np.testing.assert_allclose(arrays["output0"], reference_output(X), atol=1e-5)


# -- OIP: tritonclient --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def triton_client(server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    yield client
    client.close()


def test_tritonclient_health_and_metadata(triton_client: triton.InferenceServerClient) -> None:
    assert triton_client.is_server_live() and triton_client.is_server_ready()
    assert "binary_tensor_data" in triton_client.get_server_metadata()["extensions"]
    for model in ("tiny", "tiny_onnx"):
        assert triton_client.is_model_ready(model)
        assert triton_client.is_model_ready(model, "1.0")
        meta = triton_client.get_model_metadata(model, "1.0")
        assert meta["platform"] == PLATFORM[model]
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]
    assert not triton_client.is_model_ready("tiny", "9.9")


@pytest.mark.parametrize("model", ["tiny", "tiny_onnx"])
@pytest.mark.parametrize("binary_in", [True, False], ids=["bin-in", "json-in"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["bin-out", "json-out"])
@pytest.mark.parametrize("version", ["", "1.0"], ids=["default", "v1.0"])
def test_tritonclient_infer(
    triton_client: triton.InferenceServerClient,
    model: str,
    binary_in: bool,
    binary_out: bool,
    version: str,
) -> None:
    inp = triton.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X, binary_data=binary_in)
    out = triton.InferRequestedOutput(OUTPUT[model], binary_data=binary_out)
    result = triton_client.infer(
        model, [inp], model_version=version, outputs=[out], request_id="tc-7"
    )
    response = result.get_response()
    assert (response["id"], response["model_version"]) == ("tc-7", "1.0")
    np.testing.assert_allclose(result.as_numpy(OUTPUT[model]), reference_output(X), atol=1e-5)


def test_tritonclient_errors(triton_client: triton.InferenceServerClient) -> None:
    inp = triton.InferInput("x", [2, 8], "FP32")
    inp.set_data_from_numpy(X[:2])
    with pytest.raises(InferenceServerException, match="not registered"):
        triton_client.infer("nope", [inp])
    wrong = triton.InferInput("x", [2, 8], "FP64")
    wrong.set_data_from_numpy(X[:2].astype(np.float64))
    with pytest.raises(InferenceServerException, match="FP64"):
        triton_client.infer("tiny", [wrong])


# -- OpenAPI ------------------------------------------------------------------------------------
def test_openapi_and_docs(server: ServerProcess) -> None:
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    for route in (
        "/ping",
        "/predictions/{model_name}",
        "/predictions/{model_name}/{version}",
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{model_name}",
        "/v2/models/{model_name}/versions/{version}",
        "/v2/models/{model_name}/ready",
        "/v2/models/{model_name}/infer",
        "/v2/models/{model_name}/versions/{version}/infer",
    ):
        assert route in paths
    docs = httpx.get(f"{server.url}/docs")
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]


# -- errors -------------------------------------------------------------------------------------
def _binary_too_short() -> tuple[bytes, dict[str, str]]:
    body, headers = binary_request(X)
    return body[:-4], headers  # the header promises 96 bytes, 92 follow


def _flat(count: int) -> dict[str, Any]:
    body = oip_body()
    body["inputs"][0]["data"] = X.ravel().tolist()[:count]
    return body


# (name, path, request kwargs, status, words the message must contain)
ERRORS: list[tuple[str, str, dict[str, Any], int, tuple[str, ...]]] = [
    ("predict-unknown-model", "/predictions/nope", {"json": [0.0] * 8}, 404, ("'nope'",)),
    ("predict-unknown-version", "/predictions/tiny/9.9", {"json": [0.0] * 8}, 404, ("'9.9'",)),
    ("predict-bad-json", "/predictions/tiny", {"content": b"[1, 2,"}, 400, ("JSON",)),
    ("predict-empty", "/predictions/tiny", {"content": b""}, 400, ("no body",)),
    ("predict-shape", "/predictions/tiny", {"json": [0.0] * 7}, 400, ("'x'", "[8]")),
    ("v2-unknown-model", "/v2/models/nope/infer", {"json": oip_body()}, 404, ("'nope'",)),
    (
        "v2-unknown-version", "/v2/models/tiny/versions/9.9/infer", {"json": oip_body()},
        404, ("'9.9'",),
    ),
    ("v2-bad-json", "/v2/models/tiny/infer", {"content": b'{"inputs": ['}, 400, ("JSON",)),
    ("v2-empty", "/v2/models/tiny/infer", {"content": b""}, 400, ("JSON",)),
    (
        "v2-shape", "/v2/models/tiny_onnx/infer", {"json": oip_body(X[:, :7])},
        400, ("'x'", "[-1, 8]", "[3, 7]"),
    ),
    (
        "v2-datatype", "/v2/models/tiny/infer", {"json": oip_body(datatype="FP64")},
        400, ("'x'", "FP64", "FP32"),
    ),
    ("v2-count", "/v2/models/tiny/infer", {"json": _flat(20)}, 400, ("24", "20")),
    ("v2-no-inputs", "/v2/models/tiny/infer", {"json": {"inputs": []}}, 400, ("'inputs'",)),
    ("v2-inputs-missing", "/v2/models/tiny/infer", {"json": {"id": "1"}}, 400, ("'inputs'",)),
    (
        "v2-unknown-input", "/v2/models/tiny/infer",
        {"json": {"inputs": [{**oip_body()["inputs"][0], "name": "z"}]}}, 400, ("'z'", "x"),
    ),
    (
        "v2-unknown-datatype", "/v2/models/tiny/infer", {"json": oip_body(datatype="FP99")},
        400, ("FP99",),
    ),
    (
        "v2-unknown-output", "/v2/models/tiny/infer",
        {"json": oip_body(outputs=[{"name": "nope"}])}, 400, ("nope", "output0"),
    ),
    (
        "v2-output-parameters", "/v2/models/tiny/infer",
        {"json": oip_body(outputs=[{"name": "output0", "parameters": [True]}])},
        400, ("'output0'", "'parameters'"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "kwargs", "status", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in ERRORS],
)
def test_errors(
    server: ServerProcess, path: str, kwargs: dict[str, Any], status: int, words: tuple[str, ...]
) -> None:
    r = httpx.post(f"{server.url}{path}", **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    doc = r.json()
    if path.startswith("/v2"):
        assert set(doc) == {"error"}
        message = doc["error"]
    else:
        assert (doc["code"], doc["type"]) == (
            status,
            "ModelNotFound" if status == 404 else "InvalidInput",
        )
        message = doc["message"]
    for word in words:
        assert word in message
    assert_clean(r.text, server.store)
    assert_serves(server)


def test_binary_data_size_past_the_body(server: ServerProcess) -> None:
    body, headers = _binary_too_short()
    r = httpx.post(f"{server.url}/v2/models/tiny/infer", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert "binary_data_size" in r.json()["error"]
    bad_header = {**headers, HEADER_LENGTH: str(len(body) + 10)}
    r = httpx.post(f"{server.url}/v2/models/tiny/infer", content=body, headers=bad_header)
    assert r.status_code == 400, r.text
    assert HEADER_LENGTH in r.json()["error"]
    assert_clean(r.text, server.store)
    assert_serves(server)


@pytest.mark.parametrize(
    "path", ["/v2/models/nope", "/v2/models/tiny/versions/9.9", "/v2/models/nope/ready"]
)
def test_metadata_of_unknown_model(server: ServerProcess, path: str) -> None:
    r = httpx.get(f"{server.url}{path}")
    assert r.status_code == 404, r.text
    assert set(r.json()) == {"error"}


# -- handler failures and back-pressure, on a server of their own --------------------------------
BOOM_HANDLER = """
from scriptserve.handlers.tensor import TensorHandler


class BoomHandler(TensorHandler):
    def postprocess(self, outputs):
        for group in outputs.groups:
            for item in group:
                if float(item.arrays["x"].ravel()[0]) == 13:
                    raise ValueError("boom: the first input value is 13")
        return super().postprocess(outputs)
"""

SHORT_HANDLER = """
from scriptserve.handlers.tensor import TensorHandler


class ShortHandler(TensorHandler):
    def postprocess(self, outputs):
        return super().postprocess(outputs)[:-1]
"""

SLOW_HANDLER = """
import time

from scriptserve.handlers.tensor import TensorHandler


class SlowHandler(TensorHandler):
    def inference(self, batch):
        time.sleep(0.4)  # the workload: a model this slow keeps the one worker busy
        return super().inference(batch)
"""


class TwoOutputs(TinyMLP):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc2(torch.relu(self.fc1(x)))
        return y, y.sum(dim=1, keepdim=True)


def build_custom_store(root: Path) -> Path:
    store, work = root / "store", root / "work"
    work.mkdir(parents=True)
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    model = save_torchscript(work / "tiny.pt")
    handlers = {"boom": BOOM_HANDLER, "short": SHORT_HANDLER, "slow": SLOW_HANDLER}
    for name, source in handlers.items():
        handler = work / f"{name}_handler.py"
        handler.write_text(textwrap.dedent(source))
        argv = [
            "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
            "--handler", str(handler), "--sample-input", str(sample), "--export-path", str(store),
        ]  # fmt: skip
        assert model_archiver_main(argv) == 0
    two = save_torchscript(work / "two.pt", TwoOutputs())
    argv = [
        "--model-name", "two", "--version", "1.0", "--serialized-file", str(two),
        "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return store


@pytest.fixture(scope="module")
def custom_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Custom-handler models, one worker each and room for one waiting request."""
    store = build_custom_store(tmp_path_factory.mktemp("custom"))
    proc = ServerProcess(store, "--workers", "1", "--queue-size", "1").start()
    yield proc
    proc.stop()


def test_handler_exception_fails_only_its_request(custom_server: ServerProcess) -> None:
    url = f"{custom_server.url}/predictions/boom"
    good = X[0].tolist()
    assert httpx.post(url, json=good).status_code == 200
    r = httpx.post(url, json=[13.0, *good[1:]])
    assert r.status_code == 500, r.text
    doc = r.json()
    assert (doc["code"], doc["type"]) == (500, "InferenceFailed")
    # The exception's text stays in the server log; the client learns the class and its id.
    assert doc["message"].startswith("the handler failed: ValueError (request id ")
    assert "the first input value is 13" not in doc["message"]
    assert_clean(r.text, custom_server.store)
    r = httpx.post(url, json=good)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference_output(X[:1])[0], atol=1e-5)
    # The same on the OIP route: {"error": ...}; a good request right after is served.
    bad = np.array([[13.0, *good[1:]]], dtype=np.float32)
    r = httpx.post(f"{custom_server.url}/v2/models/boom/infer", json=oip_body(bad))
    assert r.status_code == 500, r.text
    assert r.json()["error"].startswith("the handler failed: ValueError")
    r = httpx.post(f"{custom_server.url}/v2/models/boom/infer", json=oip_body())
    assert r.status_code == 200, r.text


def test_handler_with_too_few_results(custom_server: ServerProcess) -> None:
    r = httpx.post(f"{custom_server.url}/predictions/short", json=X[0].tolist())
    assert r.status_code == 500, r.text
    message = r.json()["message"]
    assert "ShortHandler.postprocess returned 0 results for a batch of 1 requests" in message
    assert_clean(r.text, custom_server.store)
    # Other models of the same server are unaffected.
    assert httpx.post(f"{custom_server.url}/predictions/boom", json=X[0].tolist()).is_success


def test_requested_output_subset(custom_server: ServerProcess) -> None:
    url = f"{custom_server.url}/v2/models/two/infer"
    everything = httpx.post(url, json=oip_body()).json()["outputs"]
    assert [o["name"] for o in everything] == ["output0", "output1"]
    r = httpx.post(url, json=oip_body(outputs=[{"name": "output1"}]))
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    assert (out["name"], out["shape"]) == ("output1", [3, 1])
    expected = reference_output(X).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(np.reshape(out["data"], (3, 1)), expected, atol=1e-5)
    r = httpx.post(url, json=oip_body(outputs=[{"name": "output1"}, {"name": "output9"}]))
    assert r.status_code == 400
    assert "output9" in r.json()["error"]


async def _burst(url: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30.0) as client:
        calls = [client.post(url, json=X[i % 3].tolist()) for i in range(count)]
        return await asyncio.gather(*calls)


def test_full_queue_answers_503_with_retry_after(custom_server: ServerProcess) -> None:
    responses = asyncio.run(_burst(f"{custom_server.url}/predictions/slow", 10))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses, statuses
    for i, r in enumerate(responses):
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["type"] == "QueueFull"
            assert "queue is full" in r.json()["message"]
        else:
            row = X[i % 3 : i % 3 + 1]
            np.testing.assert_allclose(r.json(), reference_output(row)[0], atol=1e-5)
    # Once the burst is over, the queue has room again.
    assert httpx.post(f"{custom_server.url}/predictions/slow", json=X[0].tolist()).is_success
