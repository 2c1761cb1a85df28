"""The gRPC converters in-process, driven with a Triton client's own messages (the same wire
types as scriptserve's; the generated modules cannot share a process with tritonclient)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tsprotos
from tritonclient.grpc import service_pb2 as triton

from scriptserve.handlers.base import InferenceResponse
from scriptserve.handlers.runtime.signature import TensorSpec
from scriptserve.server.errors import InvalidInput, ModelNotFound
from scriptserve.server.grpc import converters
from scriptserve.server.inference.decoding import Served
from scriptserve.server.models.description import ModelMetadata


def _request(**fields: object) -> triton.ModelInferRequest:
    request = triton.ModelInferRequest(model_name="m", id="r7", **fields)  # type: ignore[arg-type]
    return request


def test_typed_contents_become_named_tensors_with_the_asked_outputs() -> None:
    msg = _request()
    x = msg.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    x.contents.fp32_contents.extend([1.5, 2.5])
    t = msg.inputs.add(name="t", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"a\x00")
    msg.outputs.add(name="y")
    msg.parameters["priority"].int64_param = 3
    request = converters.infer_request(msg)
    assert request.request_id == "r7"
    assert request.outputs == ["y"]
    assert request.parameters == {"priority": 3}
    assert request.inputs["x"].tolist() == [[1.5, 2.5]]
    assert request.inputs["t"].tolist() == [b"a\x00"]


def test_raw_contents_are_decoded_by_the_shared_codec() -> None:
    msg = _request()
    msg.inputs.add(name="x", datatype="INT64", shape=[3])
    msg.raw_input_contents.append(np.arange(3, dtype="<i8").tobytes())
    assert converters.infer_request(msg).inputs["x"].tolist() == [0, 1, 2]
    msg.raw_input_contents[0] = b"\0" * 5
    with pytest.raises(InvalidInput, match="needs 24 bytes, got 5"):
        converters.infer_request(msg)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda m: None, "the request has no inputs"),
        (lambda m: m.inputs.add(name="x", datatype="FP16", shape=[1]), "must be sent in raw"),
        (lambda m: m.inputs.add(name="x", datatype="FP99", shape=[1]), "input 'x'"),
        (lambda m: m.inputs.add(name="x", datatype="FP32", shape=[-1]), "'shape' must be"),
        (lambda m: m.inputs.add(name="x", datatype="FP32", shape=[2]), "needs 2 values, got 0"),
        (lambda m: [m.inputs.add(name="x", datatype="FP32", shape=[0]) for _ in range(2)],
         "appears twice"),
        (lambda m: (m.inputs.add(name="x", datatype="FP32", shape=[0]),
                    m.inputs.add(name="y", datatype="FP32", shape=[0]),
                    m.raw_input_contents.append(b"")), "raw_input_contents has 1 entries"),
    ],
)  # fmt: skip
def test_bad_requests_are_invalid_input_naming_the_problem(build: object, message: str) -> None:
    msg = _request()
    build(msg)  # type: ignore[operator]
    with pytest.raises(InvalidInput, match=message):
        converters.infer_request(msg)


def _served() -> Served:
    y = np.array([[1.0, 2.0]], dtype=np.float32)
    return Served("m", "2", InferenceResponse(outputs={"y": y}), [("y", y)])


def test_the_answer_names_the_version_that_served_it() -> None:
    response = converters.fill_infer_response(_served(), "r7", triton.ModelInferResponse())
    assert (response.model_name, response.model_version, response.id) == ("m", "2", "r7")
    assert response.outputs[0].datatype == "FP32" and list(response.outputs[0].shape) == [1, 2]
    assert np.frombuffer(response.raw_output_contents[0], "<f4").tolist() == [1.0, 2.0]


def test_a_stream_reply_carries_the_answer_or_the_error() -> None:
    loop = asyncio.new_event_loop()
    try:
        request = _request()
        ok: asyncio.Future[Served] = loop.create_future()
        ok.set_result(_served())
        reply = converters.fill_stream_reply(request, ok, triton.ModelStreamInferResponse())
        assert reply.error_message == "" and reply.infer_response.model_version == "2"
        failed: asyncio.Future[Served] = loop.create_future()
        failed.set_exception(ModelNotFound("model 'm' is not registered"))
        reply = converters.fill_stream_reply(request, failed, triton.ModelStreamInferResponse())
        assert reply.error_message == "model 'm' is not registered"
        assert (reply.infer_response.model_name, reply.infer_response.id) == ("m", "r7")
    finally:
        loop.close()


def test_metadata_fills_tensor_specs() -> None:
    meta = ModelMetadata(
        "m",
        ["1", "2"],
        "pytorch_torchscript",
        (TensorSpec("x", "FP32", (-1, 8)),),
        (TensorSpec("y", "FP32", (-1, 2)),),
    )
    response = converters.fill_metadata(meta, triton.ModelMetadataResponse())
    assert list(response.versions) == ["1", "2"]
    assert [(t.name, list(t.shape)) for t in response.inputs] == [("x", [-1, 8])]
    assert response.outputs[0].datatype == "FP32"


def test_torchserve_management_fields_zero_means_not_given() -> None:
    mgmt = tsprotos.torchserve_stubs().mgmt
    register = mgmt.RegisterModelRequest(url="m.mar", batch_size=4, synchronous=False)
    assert converters.given_fields(register) == {
        "url": "m.mar",
        "batch_size": 4,
        "synchronous": False,
        "s3_sse_kms": False,
    }
    metadata = [("scriptserve-quantize", "dynamic-int8"), ("scriptserve-worker-mode", b"process")]
    assert converters.registration_metadata(metadata) == {
        "quantize": "dynamic-int8",
        "worker_mode": "process",
    }
