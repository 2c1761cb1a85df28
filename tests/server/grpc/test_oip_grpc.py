"""Open Inference Protocol v2 over gRPC with tritonclient: health, metadata, inference with raw
and typed tensor contents (each answering exactly what the REST route answers), versions and
requested outputs; plus the standard gRPC health and reflection services."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving import ServerProcess
from testmodels import TinyMLP, reference_output, save_torchscript
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from scriptserve.archiver.cli import model_archiver_main

X = (np.arange(24, dtype=np.float32).reshape(3, 8) - 12) / 10
OUTPUT = {"tiny": "output0", "tiny_onnx": "y"}
MODELS = list(OUTPUT)
OIP_SERVICE = "inference.GRPCInferenceService"
TS_SERVICE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MGMT_SERVICE = "org.pytorch.serve.grpc.management.ManagementAPIsService"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"


class TwoOutputs(TinyMLP):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc2(torch.relu(self.fc1(x)))
        return y, y.sum(dim=1, keepdim=True)


@pytest.fixture(scope="module")
def model_store(model_store: Path) -> Path:
    """tests/server/conftest.py's store plus `two`, a model with outputs output0 and output1."""
    work = model_store.parent / "two"
    work.mkdir()
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    model = save_torchscript(work / "two.pt", TwoOutputs())
    argv = [
        "--model-name", "two", "--version", "1.0", "--serialized-file", str(model),
        "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(model_store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return model_store


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.grpc)
    yield c
    c.close()


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc) as ch:
        yield ch


def raw_input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def rest_infer(server: ServerProcess, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    body = {
        "inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.tolist()}]
    }
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body)
    assert r.status_code == 200, r.text
    return {
        o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"])
        for o in r.json()["outputs"]
    }


def tensors(specs: Any) -> list[tuple[str, str, list[int]]]:
    return [(t.name, t.datatype, list(t.shape)) for t in specs]


def assert_grpc_error(exc: pytest.ExceptionInfo[InferenceServerException], code: str) -> str:
    assert exc.value.status() == f"StatusCode.{code}", exc.value
    return str(exc.value.message())


# -- health and metadata ------------------------------------------------------------------------
def test_server_live_ready_and_metadata(
    client: triton.InferenceServerClient, server: ServerProcess
) -> None:
    assert client.is_server_live() is True
    assert client.is_server_ready() is True
    meta = client.get_server_metadata()
    rest = httpx.get(f"{server.url}/v2").json()
    assert (meta.name, meta.version, list(meta.extensions)) == (
        rest["name"],
        rest["version"],
        rest["extensions"],
    )
    assert meta.name == "scriptserve" and "binary_tensor_data" in meta.extensions


@pytest.mark.parametrize("model", MODELS)
def test_model_ready(client: triton.InferenceServerClient, model: str) -> None:
    assert client.is_model_ready(model) is True
    assert client.is_model_ready(model, "1.0") is True
    with pytest.raises(InferenceServerException) as exc:
        client.is_model_ready(model, "9.9")
    assert "'9.9'" in assert_grpc_error(exc, "NOT_FOUND")
    with pytest.raises(InferenceServerException) as exc:
        client.is_model_ready("nope")
    assert "'nope'" in assert_grpc_error(exc, "NOT_FOUND")


@pytest.mark.parametrize("model", MODELS)
def test_model_metadata_matches_rest(
    client: triton.InferenceServerClient, server: ServerProcess, model: str
) -> None:
    rest = httpx.get(f"{server.url}/v2/models/{model}").json()
    for version in ("", "1.0"):
        meta = client.get_model_metadata(model, version)
        assert (meta.name, list(meta.versions), meta.platform) == (
            rest["name"],
            rest["versions"],
            rest["platform"],
        )
        assert tensors(meta.inputs) == [("x", "FP32", [-1, 8])]
        assert tensors(meta.outputs) == [(OUTPUT[model], "FP32", [-1, 3])]
        expected = [(t["name"], t["datatype"], t["shape"]) for t in rest["inputs"]]
        assert tensors(meta.inputs) == expected
        expected = [(t["name"], t["datatype"], t["shape"]) for t in rest["outputs"]]
        assert tensors(meta.outputs) == expected
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_metadata("nope")
    assert "'nope'" in assert_grpc_error(exc, "NOT_FOUND")


# -- inference ----------------------------------------------------------------------------------
def typed_request(model: str, x: np.ndarray, **fields: Any) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest with the tensor in typed `fp32_contents` (tritonclient sends raw)."""
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    return request


def decode_outputs(response: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    assert len(response.raw_output_contents) == len(response.outputs)
    arrays = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        assert tensor.datatype == "FP32"
        arrays[tensor.name] = np.frombuffer(raw, dtype="<f4").reshape(list(tensor.shape))
    return arrays


@pytest.mark.parametrize("model", MODELS)
def test_infer_raw_and_typed_give_what_rest_gives(
    client: triton.InferenceServerClient, channel: grpc.Channel, server: ServerProcess, model: str
) -> None:
    name = OUTPUT[model]
    rest = rest_infer(server, model, X)[name]
    np.testing.assert_allclose(rest, reference_output(X), atol=1e-5)

    result = client.infer(model, [raw_input(X)], request_id="raw-1")
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (model, "1.0", "raw-1")
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == (name, "FP32", [3, 3])
    np.testing.assert_array_equal(result.as_numpy(name), rest)

    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    typed = stub.ModelInfer(typed_request(model, X, id="typed-1"), timeout=10)
    assert (typed.model_name, typed.model_version, typed.id) == (model, "1.0", "typed-1")
    outputs = decode_outputs(typed)
    assert list(outputs) == [name]
    np.testing.assert_array_equal(outputs[name], rest)


def test_infer_typed_fp64_is_checked_against_the_signature(
    channel: grpc.Channel, server: ServerProcess
) -> None:
    """FP64 travels in fp64_contents; the model takes FP32, and gRPC says so as REST does."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="x", datatype="FP64", shape=[1, 8])
    tensor.contents.fp64_contents.extend([0.5] * 8)
    with pytest.raises(grpc.RpcError) as exc:
        stub.ModelInfer(request, timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP64", "data": [0.5] * 8}]}
    rest = httpx.post(f"{server.url}/v2/models/tiny/infer", json=body)
    assert rest.status_code == 400
    assert exc.value.details() == rest.json()["error"]
    assert "FP64" in exc.value.details() and "FP32" in exc.value.details()


def test_infer_specific_version(client: triton.InferenceServerClient) -> None:
    result = client.infer("tiny", [raw_input(X[:1])], model_version="1.0")
    assert result.get_response().model_version == "1.0"
    np.testing.assert_allclose(result.as_numpy("output0"), reference_output(X[:1]), atol=1e-5)
    with pytest.raises(InferenceServerException) as exc:
        client.infer("tiny", [raw_input(X[:1])], model_version="9.9")
    assert "'9.9'" in assert_grpc_error(exc, "NOT_FOUND")


def test_requested_output_subset(
    client: triton.InferenceServerClient, server: ServerProcess
) -> None:
    everything = client.infer("two", [raw_input(X)]).get_response()
    assert [o.name for o in everything.outputs] == ["output0", "output1"]
    rest = rest_infer(server, "two", X)

    result = client.infer("two", [raw_input(X)], outputs=[triton.InferRequestedOutput("output1")])
    (out,) = result.get_response().outputs
    assert (out.name, list(out.shape)) == ("output1", [3, 1])
    np.testing.assert_array_equal(result.as_numpy("output1"), rest["output1"])
    expected = reference_output(X).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(result.as_numpy("output1"), expected, atol=1e-5)
    assert result.as_numpy("output0") is None

    outputs = [triton.InferRequestedOutput("output1"), triton.InferRequestedOutput("output9")]
    with pytest.raises(InferenceServerException) as exc:
        client.infer("two", [raw_input(X)], outputs=outputs)
    message = assert_grpc_error(exc, "INVALID_ARGUMENT")
    assert "output9" in message and "output0, output1" in message


# -- gRPC health and reflection -----------------------------------------------------------------
def health_status(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


@pytest.mark.parametrize("service", ["", OIP_SERVICE, TS_SERVICE])
def test_health_check_inference_port(server: ServerProcess, service: str) -> None:
    assert health_status(server.grpc, service) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("service", ["", MGMT_SERVICE])
def test_health_check_management_port(server: ServerProcess, service: str) -> None:
    assert health_status(server.grpc_mgmt, service) == health_pb2.HealthCheckResponse.SERVING


def test_health_check_of_an_unknown_service(server: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        health_status(server.grpc, "no.such.Service")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def reflect(
    target: str, request: reflection_pb2.ServerReflectionRequest, key: str | None = None
) -> Any:
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        calls = stub.ServerReflectionInfo(iter([request]), timeout=5, metadata=metadata)
        (response,) = list(calls)
    return response


@pytest.mark.parametrize(
    ("port", "services"),
    [
        ("grpc", {OIP_SERVICE, TS_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE}),
        ("grpc_mgmt", {MGMT_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE}),
    ],
)
def test_reflection_lists_the_services(
    server: ServerProcess, port: str, services: set[str]
) -> None:
    # The management port checks its key on every method but health, reflection included.
    key = server.management_key if port == "grpc_mgmt" else None
    response = reflect(
        getattr(server, port), reflection_pb2.ServerReflectionRequest(list_services=""), key
    )
    assert {s.name for s in response.list_services_response.service} == services


def test_reflection_describes_the_oip_service(server: ServerProcess) -> None:
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=OIP_SERVICE)
    response = reflect(server.grpc, request)
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    (oip,) = [f for f in files if f.service]
    assert oip.package == "inference"
    assert [m.name for m in oip.service[0].method] == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    ]


# -- readiness at startup -----------------------------------------------------------------------
@pytest.mark.slow
def test_server_is_ready_only_once_every_startup_model_is(tmp_path: Path) -> None:
    """`big` takes a while to open (128 MB to unpack and hash) before it is registered, and `tiny`
    loads after it: ServerReady stays false, and the inference port's gRPC health NOT_SERVING,
    until both are loaded. The management port serves (and says so) from the start."""
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    (work / "weights.bin").write_bytes(bytes(128 << 20))
    model = save_torchscript(work / "tiny.pt")
    for name, extra in (
        ("big", ["--extra-files", str(work / "weights.bin"), "--archive-format", "zip-store"]),
        ("tiny", []),
    ):
        argv = [
            "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
            "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store),
            *extra,
        ]  # fmt: skip
        assert model_archiver_main(argv) == 0
    proc = ServerProcess(store).start(wait_ready=False)
    try:
        with grpc.insecure_channel(proc.grpc) as ch:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
            deadline = time.monotonic() + 30
            serving = health_pb2.HealthCheckResponse.SERVING
            assert health_status(proc.grpc_mgmt, "") == serving
            # Health is read before readiness: once health says SERVING, the readiness read
            # after it must be true (the reverse order races with the server turning ready).
            saw_not_ready = False
            while True:
                health = health_status(proc.grpc, ""), health_status(proc.grpc, OIP_SERVICE)
                ready = stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5).ready
                if health == (serving, serving):
                    assert ready
                    break
                saw_not_ready |= not ready
                assert time.monotonic() < deadline, proc.output()
                time.sleep(0.01)
            assert saw_not_ready, "the server was ready before its startup models were loaded"
            for name in ("big", "tiny"):
                request = service_pb2.ModelReadyRequest(name=name)
                assert stub.ModelReady(request, timeout=5).ready, name
    finally:
        proc.stop()
