"""TorchServe's gRPC APIs with a client generated from the project's protos: Ping, Predictions
(the same bytes REST /predictions answers), both streaming RPCs, and every management RPC."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf import empty_pb2
from serving import ServerProcess
from testmodels import reference_output

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

X = (np.arange(24, dtype=np.float32).reshape(3, 8) - 12) / 10
COPY = "tiny_grpc"


@pytest.fixture(scope="module")
def inference(server: ServerProcess, torchserve_stubs: SimpleNamespace) -> Iterator[Any]:
    with grpc.insecure_channel(server.grpc) as channel:
        yield torchserve_stubs.ts_grpc.InferenceAPIsServiceStub(channel)


class ManagementKey(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Send the management key as `authorization` metadata on every call."""

    def __init__(self, key: str) -> None:
        self.metadata = ("authorization", f"Bearer {key}")

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        details = details._replace(metadata=[*(details.metadata or []), self.metadata])
        return continuation(details, request)


@pytest.fixture(scope="module")
def management(server: ServerProcess, torchserve_stubs: SimpleNamespace) -> Iterator[Any]:
    with grpc.insecure_channel(server.grpc_mgmt) as channel:
        keyed = grpc.intercept_channel(channel, ManagementKey(server.management_key))
        yield torchserve_stubs.mgmt_grpc.ManagementAPIsServiceStub(keyed)


def request(ts: SimpleNamespace, model: str, row: np.ndarray, **fields: Any) -> Any:
    return ts.ts.PredictionsRequest(
        model_name=model, input={"data": json.dumps(row.tolist()).encode()}, **fields
    )


def rest_prediction(server: ServerProcess, model: str, row: np.ndarray) -> bytes:
    r = httpx.post(f"{server.url}/predictions/{model}", content=json.dumps(row.tolist()).encode())
    assert r.status_code == 200, r.text
    return r.content


def msg(response: Any) -> Any:
    return json.loads(response.msg)


def rpc_error(call: Any, *args: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call(*args, timeout=30)
    return exc.value


# -- inference ----------------------------------------------------------------------------------
def test_ping(inference: Any) -> None:
    response = inference.Ping(empty_pb2.Empty(), timeout=10)
    assert json.loads(response.health) == {"status": "Healthy"}


@pytest.mark.parametrize("model", ["tiny", "tiny_onnx"])
def test_predictions_answer_what_rest_answers(
    inference: Any, torchserve_stubs: SimpleNamespace, server: ServerProcess, model: str
) -> None:
    response = inference.Predictions(request(torchserve_stubs, model, X[0]), timeout=10)
    assert response.prediction == rest_prediction(server, model, X[0])
    np.testing.assert_allclose(
        json.loads(response.prediction), reference_output(X[:1])[0], atol=1e-5
    )
    assert not response.HasField("status") and not response.HasField("sequence_id")
    versioned = request(torchserve_stubs, model, X[0], model_version="1.0")
    assert inference.Predictions(versioned, timeout=10).prediction == response.prediction


def test_predictions_errors(inference: Any, torchserve_stubs: SimpleNamespace) -> None:
    error = rpc_error(inference.Predictions, request(torchserve_stubs, "nope", X[0]))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in error.details()
    versioned = request(torchserve_stubs, "tiny", X[0], model_version="9.9")
    error = rpc_error(inference.Predictions, versioned)
    assert (error.code(), "'9.9'" in error.details()) == (grpc.StatusCode.NOT_FOUND, True)
    error = rpc_error(inference.Predictions, request(torchserve_stubs, "tiny", X[0, :7]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x'" in error.details() and "[8]" in error.details()
    empty = torchserve_stubs.ts.PredictionsRequest(model_name="tiny")
    error = rpc_error(inference.Predictions, empty)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'data'" in error.details()


def test_stream_predictions_streams_the_answer(
    inference: Any, torchserve_stubs: SimpleNamespace, server: ServerProcess
) -> None:
    responses = list(
        inference.StreamPredictions(request(torchserve_stubs, "tiny", X[1]), timeout=10)
    )
    assert [r.prediction for r in responses] == [rest_prediction(server, "tiny", X[1])]
    stream = inference.StreamPredictions(request(torchserve_stubs, "nope", X[1]), timeout=10)
    with pytest.raises(grpc.RpcError) as exc:
        list(stream)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_stream_predictions2_answers_each_request_in_order(
    inference: Any, torchserve_stubs: SimpleNamespace, server: ServerProcess
) -> None:
    requests = [
        request(torchserve_stubs, "tiny", X[0], sequence_id="seq-0"),
        request(torchserve_stubs, "tiny_onnx", X[1], sequence_id="seq-1"),
        request(torchserve_stubs, "nope", X[2], sequence_id="seq-2"),
        request(torchserve_stubs, "tiny", X[2]),
    ]
    responses = list(inference.StreamPredictions2(iter(requests), timeout=30))
    assert len(responses) == 4
    assert [r.sequence_id for r in responses[:3]] == ["seq-0", "seq-1", "seq-2"]
    assert not responses[3].HasField("sequence_id")
    assert responses[0].prediction == rest_prediction(server, "tiny", X[0])
    assert responses[1].prediction == rest_prediction(server, "tiny_onnx", X[1])
    assert responses[3].prediction == rest_prediction(server, "tiny", X[2])
    # One bad request fails in its own response; the stream goes on.
    failed = responses[2]
    assert failed.prediction == b""
    assert failed.status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "'nope'" in failed.status.message
    for ok in (responses[0], responses[1], responses[3]):
        assert not ok.HasField("status")


# -- management ---------------------------------------------------------------------------------
def test_list_models(
    management: Any, torchserve_stubs: SimpleNamespace, server: ServerProcess
) -> None:
    mgmt = torchserve_stubs.mgmt
    listing = msg(management.ListModels(mgmt.ListModelsRequest(), timeout=10))
    assert listing == httpx.get(f"{server.mgmt}/models", headers=server.mgmt_headers).json()
    assert listing == {
        "models": [
            {"modelName": "tiny", "modelUrl": "tiny.mar"},
            {"modelName": "tiny_onnx", "modelUrl": "tiny_onnx.mar"},
        ]
    }
    page = msg(management.ListModels(mgmt.ListModelsRequest(limit=1), timeout=10))
    assert page == {"models": [{"modelName": "tiny", "modelUrl": "tiny.mar"}], "nextPageToken": "1"}
    page = msg(management.ListModels(mgmt.ListModelsRequest(limit=1, next_page_token=1)))
    assert [m["modelName"] for m in page["models"]] == ["tiny_onnx"] and "nextPageToken" not in page
    error = rpc_error(management.ListModels, mgmt.ListModelsRequest(limit=1001))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "limit must be between 1 and 1000"


def test_describe_model(
    management: Any, torchserve_stubs: SimpleNamespace, server: ServerProcess
) -> None:
    mgmt = torchserve_stubs.mgmt
    (described,) = msg(management.DescribeModel(mgmt.DescribeModelRequest(model_name="tiny")))
    (rest,) = httpx.get(f"{server.mgmt}/models/tiny", headers=server.mgmt_headers).json()
    assert described.keys() == rest.keys()
    for key in ("modelName", "modelVersion", "modelUrl", "minWorkers", "batchSize", "isDefault"):
        assert described[key] == rest[key], key
    assert (described["modelName"], described["modelVersion"]) == ("tiny", "1.0")
    assert len(described["workers"]) == 2 == described["minWorkers"]
    assert {w["status"] for w in described["workers"]} == {"READY"}
    assert described["jobQueueStatus"]["pendingRequests"] == 0
    versioned = mgmt.DescribeModelRequest(model_name="tiny", model_version="1.0")
    assert msg(management.DescribeModel(versioned))[0]["modelVersion"] == "1.0"
    error = rpc_error(management.DescribeModel, mgmt.DescribeModelRequest(model_name="nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in error.details()


def describe(management: Any, mgmt: Any, name: str) -> dict[str, Any]:
    (described,) = msg(management.DescribeModel(mgmt.DescribeModelRequest(model_name=name)))
    return described  # type: ignore[no-any-return]


def test_register_scale_set_default_unregister(
    management: Any, inference: Any, torchserve_stubs: SimpleNamespace, server: ServerProcess
) -> None:
    mgmt = torchserve_stubs.mgmt
    shutil.copy(server.store / "tiny.mar", server.store / "tiny_copy.mar")
    register = mgmt.RegisterModelRequest(
        url="tiny_copy.mar", model_name=COPY, initial_workers=1, synchronous=True
    )
    done = msg(management.RegisterModel(register, timeout=60))
    assert done == {"status": f'Model "{COPY}" Version: 1.0 registered with 1 initial workers'}
    described = describe(management, mgmt, COPY)
    assert (described["modelUrl"], len(described["workers"])) == ("tiny_copy.mar", 1)
    response = inference.Predictions(request(torchserve_stubs, COPY, X[2]), timeout=10)
    assert response.prediction == rest_prediction(server, "tiny", X[2])

    error = rpc_error(management.RegisterModel, register)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert COPY in error.details()
    missing = mgmt.RegisterModelRequest(url="missing.mar", synchronous=True)
    error = rpc_error(management.RegisterModel, missing)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == "archive 'missing.mar' is not in the model store"
    outside = mgmt.RegisterModelRequest(url="../tiny.mar", synchronous=True)
    error = rpc_error(management.RegisterModel, outside)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(server.store) not in error.details()

    scale = mgmt.ScaleWorkerRequest(model_name=COPY, min_worker=3, synchronous=True)
    done = msg(management.ScaleWorker(scale, timeout=60))
    assert done == {"status": f"Workers scaled to 3 for model: {COPY}, version: 1.0"}
    described = describe(management, mgmt, COPY)
    assert (described["minWorkers"], len(described["workers"])) == (3, 3)
    error = rpc_error(management.ScaleWorker, mgmt.ScaleWorkerRequest(model_name="nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND

    default = mgmt.SetDefaultRequest(model_name=COPY, model_version="1.0")
    done = msg(management.SetDefault(default, timeout=10))
    assert done == {"status": f'Default version successfully updated for model "{COPY}" to "1.0"'}
    assert describe(management, mgmt, COPY)["isDefault"] is True
    error = rpc_error(
        management.SetDefault, mgmt.SetDefaultRequest(model_name=COPY, model_version="9.9")
    )
    assert (error.code(), "'9.9'" in error.details()) == (grpc.StatusCode.NOT_FOUND, True)

    unregister = mgmt.UnregisterModelRequest(model_name=COPY, model_version="1.0")
    done = msg(management.UnregisterModel(unregister, timeout=60))
    assert done == {"status": f'Model "{COPY}" version 1.0 unregistered'}
    error = rpc_error(management.DescribeModel, mgmt.DescribeModelRequest(model_name=COPY))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    error = rpc_error(inference.Predictions, request(torchserve_stubs, COPY, X[2]))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    error = rpc_error(management.UnregisterModel, unregister)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    # The models the server started with are untouched.
    listing = msg(management.ListModels(mgmt.ListModelsRequest(), timeout=10))
    assert [m["modelName"] for m in listing["models"]] == ["tiny", "tiny_onnx"]
