"""The OIP JSON body and TorchServe's shapes, in-process."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.codec import oip_json, torchserve
from scriptserve.server.errors import InvalidInput


def _body(doc: dict[str, object], binary: bytes = b"") -> tuple[bytes, str | None]:
    header = json.dumps(doc).encode()
    return header + binary, (str(len(header)) if binary else None)


def test_a_json_request_becomes_named_tensors_and_asked_outputs() -> None:
    body, length = _body(
        {
            "id": "r1",
            "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
            "outputs": [{"name": "y"}],
        }
    )
    decoded = oip_json.decode_request(body, length)
    assert decoded.inference.request_id == "r1"
    assert decoded.inference.outputs == ["y"]
    assert decoded.inference.inputs["x"].tolist() == [[1.0, 2.0]]


def test_binary_tensors_follow_the_json_header() -> None:
    raw = np.arange(4, dtype=np.float32).tobytes()
    spec = {
        "name": "x",
        "shape": [2, 2],
        "datatype": "FP32",
        "parameters": {"binary_data_size": len(raw)},
    }
    body, length = _body({"inputs": [spec]}, raw)
    decoded = oip_json.decode_request(body, length)
    assert decoded.inference.inputs["x"].tolist() == [[0, 1], [2, 3]]
    with pytest.raises(InvalidInput, match="longer than the inputs' binary_data_size"):
        oip_json.decode_request(body + b"\0", length)


@pytest.mark.parametrize("length", ["²", "-1", "1e3", " 12", "99999"])
def test_the_header_length_is_ascii_digits_within_the_body(length: str) -> None:
    body, _ = _body({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length must be"):
        oip_json.decode_request(body, length)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"inputs": []}, "non-empty 'inputs' list"),
        ({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}, "an input has no 'name'"),
        ({"inputs": [{"name": "x", "shape": [True], "datatype": "FP32", "data": [1]}]},
         "'shape' must be a list"),
        ({"inputs": [{"name": "x", "shape": [1], "data": [1]}]}, "'datatype' is missing"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]},
         "neither 'data' nor binary_data_size"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], "id": 3},
         "'id' must be a string"),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
          "outputs": ["y"]}, "each entry of 'outputs' must be an object"),
    ],
)  # fmt: skip
def test_malformed_requests_say_what_to_fix(doc: dict[str, object], message: str) -> None:
    body, length = _body(doc)
    with pytest.raises(InvalidInput, match=message):
        oip_json.decode_request(body, length)


def test_the_answer_sends_binary_outputs_when_asked() -> None:
    body, length = _body(
        {
            "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    )
    wire = oip_json.OipBody(body, length, {})
    wire.decode()
    y = np.array([[1.5, 2.5]], dtype=np.float32)
    payload, header_length = wire.encode("m", "2", [("y", y)])
    assert header_length is not None
    doc = orjson.loads(payload[:header_length])
    assert doc["model_version"] == "2"
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert np.frombuffer(payload[header_length:], np.float32).tolist() == [1.5, 2.5]


def test_torchserve_fields_pick_data_then_body_then_the_first() -> None:
    assert torchserve.predictions_request({"data": b"1", "body": b"2"}).body == b"1"
    assert torchserve.predictions_request({"body": b"2", "x": b"3"}).body == b"2"
    assert torchserve.predictions_request({"x": b"3"}).body == b"3"
    with pytest.raises(InvalidInput, match="no input fields"):
        torchserve.predictions_request({})
    with pytest.raises(InvalidInput, match="has no body"):
        torchserve.body_request(b"", "application/json")


def test_torchserve_payloads_and_health() -> None:
    assert torchserve.prediction_payload(InferenceResponse(body=b"\x01")) == (
        b"\x01",
        "application/octet-stream",
    )
    payload, kind = torchserve.prediction_payload(InferenceResponse(outputs={"y": np.ones(2)}))
    assert (orjson.loads(payload), kind) == ([1.0, 1.0], "application/json")
    assert torchserve.health(True) == {"status": "Healthy"}
    assert torchserve.health(False) == {"status": "Unhealthy"}


def test_parameters_holding_a_data_array_reach_the_handler_as_sent() -> None:
    body = (
        b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}], '
        b'"parameters": {"data": [3, 4], "nested": {"data": [[5]]}}}'
    )
    request = oip_json.decode_request(body, None, {})
    assert request.inference.parameters == {"data": [3, 4], "nested": {"data": [[5]]}}
    assert request.inference.inputs["x"].tolist() == [1.0, 2.0]
