"""Dynamic int8 at load: `quantize: dynamic-int8` in the model config or at registration (REST
and gRPC), the on-disk cache across restarts, the accuracy guard, and int8 in describe/metadata."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
import yaml
from serving import ServerProcess
from testmodels import save_torchscript
from torch import nn
from tritonclient.grpc import service_pb2 as oip
from tritonclient.grpc import service_pb2_grpc as oip_grpc
from tsprotos import torchserve_stubs

from scriptserve.archiver.archive import sha256_file
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.archiver.quantize import ValidationSamples

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

TOLERANCE = 0.05
"""int8 outputs stay within this of fp32 on X."""
LOOSE = {"quantizeMinTop1Agreement": 0.9, "quantizeMaxAccuracyDrop": 0.1}
"""An untrained MLP has near-tied logits; the guard's defaults are for trained models."""
X = np.random.default_rng(7).standard_normal((8, 64)).astype(np.float32)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class ConvOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.conv(x), 1)


def fp32_of(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return MLP().eval()(torch.from_numpy(x)).numpy()


def _onnx(path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            MLP().eval(),
            (torch.zeros(1, 64),),
            str(path),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
            dynamo=False,
        )
    return path


def _archive(
    model: Path, name: str, store: Path, *extra: str, config: dict[str, Any] | None = None
) -> None:
    folder = model.parent
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--sample-input", str(folder / "sample.json"), "--export-path", str(store),
        "--validation-file", str(folder / "validation.npz"), *extra,
    ]  # fmt: skip
    if config is not None:
        path = folder / f"{name}-config.yaml"
        path.write_text(yaml.safe_dump(config))
        argv += ["--config-file", str(path)]
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quantize")
    models, store = root / "models", root / "store"
    models.mkdir()
    (models / "sample.json").write_text(json.dumps(X[0].tolist()))
    rows = np.random.default_rng(8).standard_normal((100, 64)).astype(np.float32)
    ValidationSamples({"x": rows}, labels=fp32_of(rows).argmax(1)).save(models / "validation.npz")
    pt = save_torchscript(models / "mlp.pt", MLP())
    onnx = _onnx(models / "mlp.onnx")
    at_load = {"quantize": "dynamic-int8", **LOOSE}
    loose_flags = ("--min-top1-agreement", "0.9", "--max-accuracy-drop", "0.1")
    _archive(pt, "mlp", store, config=at_load)
    _archive(pt, "mlp_int8", store, "--quantize", "dynamic-int8", *loose_flags)
    _archive(onnx, "mlp_onnx", store, config=at_load)
    _archive(onnx, "mlp_onnx_int8", store, "--quantize", "dynamic-int8", *loose_flags)
    _archive(pt, "plain", store, config=LOOSE)
    _archive(pt, "strict", store, config={"quantizeMinTop1Agreement": 1.01})
    conv = save_torchscript(models / "conv.pt", ConvOnly())
    argv = [
        "--model-name", "conv", "--version", "1.0", "--serialized-file", str(conv),
        "--input-shape", "1,6,6", "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return store


STARTUP = ("mlp", "mlp_int8", "mlp_onnx", "mlp_onnx_int8")


def start(store: Path) -> ServerProcess:
    models = [f"{m}={m}.mar" for m in STARTUP]
    cache = store.parent / "cache"
    return ServerProcess(
        store,
        "--enable-model-api",
        "--workers",
        "1",
        "--models",
        *models,
        env={"SCRIPTSERVE_QUANTIZE_CACHE_DIR": str(cache)},
    ).start(timeout_s=180)


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = start(store)
    yield proc
    proc.stop()


def infer(server: ServerProcess, model: str, x: np.ndarray = X) -> np.ndarray:
    body = {
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def describe(server: ServerProcess, model: str) -> dict[str, Any]:
    r = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()[0]  # type: ignore[no-any-return]


# -- outputs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("at_load", "at_archive"), [("mlp", "mlp_int8"), ("mlp_onnx", "mlp_onnx_int8")]
)
def test_load_time_int8_matches_archive_time_and_fp32(
    server: ServerProcess, at_load: str, at_archive: str
) -> None:
    loaded, archived = infer(server, at_load), infer(server, at_archive)
    np.testing.assert_allclose(loaded, archived, rtol=0, atol=1e-5)
    diff = np.max(np.abs(loaded - fp32_of(X)))
    assert 0 < diff < TOLERANCE  # int8: close to fp32, and not fp32 itself


# -- describe and metadata ---------------------------------------------------------------------
def test_describe_shows_int8_and_where_it_came_from(server: ServerProcess, store: Path) -> None:
    info = describe(server, "mlp")
    assert info["quantization"] == "dynamic-int8"
    q = info["quantizationInfo"]
    assert q["appliedAt"] == "load"
    models = store.parent / "models"
    assert q["sourceSha256"] == sha256_file(models / "mlp.pt")
    assert q["sizeRatio"] > 3 and q["latencyRatio"] > 0 and 0 < q["maxAbsDiff"] < TOLERANCE
    assert q["validation"]["samples"] == 100
    archived = describe(server, "mlp_onnx_int8")
    assert archived["quantization"] == "dynamic-int8"
    assert archived["quantizationInfo"]["appliedAt"] == "archive"
    assert archived["quantizationInfo"]["sourceSha256"] == sha256_file(models / "mlp.onnx")


def test_oip_metadata_parameters(server: ServerProcess) -> None:
    meta = httpx.get(f"{server.url}/v2/models/mlp").json()
    params = meta["parameters"]
    assert params["quantization"] == "dynamic-int8"
    assert params["quantization_applied_at"] == "load"
    assert params["quantization_size_ratio"] > 3
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]


def test_grpc_metadata_and_describe(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        response, call = stub.ModelMetadata.with_call(oip.ModelMetadataRequest(name="mlp_onnx"))
    trailing = dict(call.trailing_metadata())
    assert response.name == "mlp_onnx"
    assert trailing["scriptserve-quantization"] == "dynamic-int8"
    assert trailing["scriptserve-quantization-applied-at"] == "load"
    auth = (("authorization", f"Bearer {server.management_key}"),)
    with grpc.insecure_channel(server.grpc_mgmt) as channel:
        stub = torchserve_stubs().mgmt_grpc.ManagementAPIsServiceStub(channel)
        reply = stub.DescribeModel(
            torchserve_stubs().mgmt.DescribeModelRequest(model_name="mlp"), metadata=auth
        )
    assert json.loads(reply.msg)[0]["quantization"] == "dynamic-int8"


# -- registration ------------------------------------------------------------------------------
def register(server: ServerProcess, url: str, name: str, **params: str) -> httpx.Response:
    query = {"url": url, "model_name": name, "initial_workers": "1", **params}
    return httpx.post(
        f"{server.mgmt}/models", params=query, headers=server.mgmt_headers, timeout=180
    )


def unregister(server: ServerProcess, name: str) -> None:
    r = httpx.delete(f"{server.mgmt}/models/{name}", headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text


def test_register_with_quantize_rest(server: ServerProcess) -> None:
    r = register(server, "plain.mar", "plain_q", quantize="dynamic-int8")
    assert r.status_code == 200, r.text
    try:
        assert describe(server, "plain_q")["quantization"] == "dynamic-int8"
        np.testing.assert_allclose(infer(server, "plain_q"), infer(server, "mlp_int8"), atol=1e-5)
    finally:
        unregister(server, "plain_q")
    r = register(server, "plain.mar", "plain_fp32")
    assert r.status_code == 200, r.text
    try:
        assert describe(server, "plain_fp32")["quantization"] == "none"
        assert "parameters" not in httpx.get(f"{server.url}/v2/models/plain_fp32").json()
        np.testing.assert_allclose(infer(server, "plain_fp32"), fp32_of(X), atol=1e-5)
    finally:
        unregister(server, "plain_fp32")


def test_register_with_quantize_grpc(server: ServerProcess) -> None:
    auth = (
        ("authorization", f"Bearer {server.management_key}"),
        ("scriptserve-quantize", "dynamic-int8"),
    )
    request = torchserve_stubs().mgmt.RegisterModelRequest(
        url="plain.mar", model_name="plain_grpc", initial_workers=1, synchronous=True
    )
    with grpc.insecure_channel(server.grpc_mgmt) as channel:
        stub = torchserve_stubs().mgmt_grpc.ManagementAPIsServiceStub(channel)
        stub.RegisterModel(request, metadata=auth, timeout=180)
    try:
        assert describe(server, "plain_grpc")["quantization"] == "dynamic-int8"
    finally:
        unregister(server, "plain_grpc")


@pytest.mark.parametrize(
    ("url", "quantize", "message"),
    [
        ("plain.mar", "int4", "use one of none, dynamic-int8"),
        ("strict.mar", "dynamic-int8", "int8 refused"),
        ("conv.mar", "dynamic-int8", "nothing to quantize"),
    ],
)
def test_register_refusals_are_clear_400s(
    server: ServerProcess, url: str, quantize: str, message: str
) -> None:
    r = register(server, url, "refused", quantize=quantize)
    assert r.status_code == 400, r.text
    assert message in r.text
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200  # others unaffected


# -- the cache across a restart ----------------------------------------------------------------
def test_restart_uses_the_cache(server: ServerProcess, store: Path) -> None:
    assert describe(server, "mlp")["quantizationInfo"]["cached"] is False
    assert "converted" in server.output()
    cache = store.parent / "cache"
    entries = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    source = sha256_file(store.parent / "models" / "mlp.pt")
    assert any(n.startswith(source) and n.endswith(".pt") for n in entries), entries
    before = infer(server, "mlp")
    second = start(store)
    try:
        info = describe(second, "mlp")
        assert info["quantizationInfo"]["cached"] is True
        assert describe(second, "mlp_onnx")["quantizationInfo"]["cached"] is True
        assert "dynamic int8 (from cache)" in second.output()
        np.testing.assert_array_equal(infer(second, "mlp"), before)
    finally:
        second.stop()
    after = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert {k: after[k] for k in entries} == entries  # nothing was converted again
