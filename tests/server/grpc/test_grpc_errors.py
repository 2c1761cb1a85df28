"""OIP gRPC errors: each bad request gets the status code its error names and the message REST
gives for the same request; back-pressure, deadlines, the message size limit, and a storm of
cancelled calls that must leave nothing behind."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from serving import ServerProcess
from testmodels import reference_output
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from .conftest import MAX_BATCH, MAX_MESSAGE_BYTES, SLEEP_S, metric, pending_requests

# Slow: servers started for a few tests each.
pytestmark = pytest.mark.slow

X = (np.arange(24, dtype=np.float32).reshape(3, 8) - 12) / 10
CANCELLED_CALLS = 1000


def raw_request(
    model: str, x: np.ndarray, datatype: str = "FP32", name: str = "x", **fields: Any
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    request.inputs.add(name=name, datatype=datatype, shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def rest_body(x: np.ndarray, datatype: str = "FP32", name: str = "x", **extra: Any) -> Any:
    tensor = {"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.tolist()}
    return {"inputs": [tensor], **extra}


def grpc_error(target: str, request: service_pb2.ModelInferRequest) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, timeout=30)
    return exc.value


def infer_ok(target: str, model: str, x: np.ndarray) -> np.ndarray:
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(raw_request(model, x), timeout=30)
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(
        list(response.outputs[0].shape)
    )


# (id, model, version, gRPC request, REST body, gRPC code, HTTP status)
SAME_AS_REST = [
    ("unknown-model", "nope", "", raw_request("nope", X), rest_body(X), "NOT_FOUND", 404),
    ("unknown-version", "tiny", "9.9", raw_request("tiny", X, model_version="9.9"), rest_body(X),
     "NOT_FOUND", 404),
    ("wrong-shape", "tiny_onnx", "", raw_request("tiny_onnx", X[:, :7].copy()),
     rest_body(X[:, :7]), "INVALID_ARGUMENT", 400),
    ("wrong-datatype", "tiny", "", raw_request("tiny", X.astype(np.float64), "FP64"),
     rest_body(X, "FP64"), "INVALID_ARGUMENT", 400),
    ("unknown-input", "tiny", "", raw_request("tiny", X, name="z"), rest_body(X, name="z"),
     "INVALID_ARGUMENT", 400),
    ("unknown-output", "tiny", "",
     raw_request("tiny", X, outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(
         name="nope")]),
     rest_body(X, outputs=[{"name": "nope"}]), "INVALID_ARGUMENT", 400),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "version", "request_", "body", "code", "status"),
    [pytest.param(*case[1:], id=case[0]) for case in SAME_AS_REST],
)
def test_error_code_and_message_match_rest(
    server: ServerProcess,
    model: str,
    version: str,
    request_: service_pb2.ModelInferRequest,
    body: Any,
    code: str,
    status: int,
) -> None:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    r = httpx.post(f"{server.url}{path}", json=body)
    assert r.status_code == status, r.text
    error = grpc_error(server.grpc, request_)
    assert error.code() == getattr(grpc.StatusCode, code)
    assert error.details() == r.json()["error"]
    assert str(server.store.parent) not in error.details()
    np.testing.assert_allclose(infer_ok(server.grpc, "tiny", X), reference_output(X), atol=1e-5)


def test_tritonclient_sees_the_same_code_and_message(server: ServerProcess) -> None:
    with triton.InferenceServerClient(server.grpc) as client:
        tensor = triton.InferInput("x", [3, 7], "FP32")
        tensor.set_data_from_numpy(X[:, :7].copy())
        with pytest.raises(InferenceServerException) as exc:
            client.infer("tiny_onnx", [tensor])
    assert exc.value.status() == "StatusCode.INVALID_ARGUMENT"
    rest = httpx.post(f"{server.url}/v2/models/tiny_onnx/infer", json=rest_body(X[:, :7]))
    assert exc.value.message() == rest.json()["error"]
    assert "'x'" in exc.value.message() and "[-1, 8]" in exc.value.message()


def test_raw_input_contents_count_mismatch(server: ServerProcess) -> None:
    request = raw_request("tiny", X)
    request.raw_input_contents.append(X.tobytes())
    error = grpc_error(server.grpc, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "raw_input_contents has 2 entries for 1 inputs; send one per input, in order"
    )


def test_raw_input_contents_of_the_wrong_size(server: ServerProcess) -> None:
    request = service_pb2.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="x", datatype="FP32", shape=[3, 8])
    request.raw_input_contents.append(X.tobytes()[:-4])
    error = grpc_error(server.grpc, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'x'" in error.details() and "96" in error.details() and "92" in error.details()


def test_raw_and_typed_contents_together(server: ServerProcess) -> None:
    request = raw_request("tiny", X)
    request.inputs[0].contents.fp32_contents.extend(X.ravel().tolist())
    error = grpc_error(server.grpc, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "use either raw_input_contents or contents, not both"


@pytest.mark.parametrize(
    ("datatype", "message"),
    [
        ("FP16", "input 'x': FP16 must be sent in raw_input_contents"),
        ("BF16", "input 'x': BF16 is not supported; send FP32 or FP16"),
    ],
)
def test_half_precision_as_typed_contents(
    server: ServerProcess, datatype: str, message: str
) -> None:
    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[1, 8])
    tensor.contents.fp32_contents.extend([0.5] * 8)
    error = grpc_error(server.grpc, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == message


def test_typed_contents_count_mismatch(server: ServerProcess) -> None:
    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[3, 8])
    tensor.contents.fp32_contents.extend(X.ravel().tolist()[:20])
    error = grpc_error(server.grpc, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "input 'x': shape [3, 8] needs 24 values, got 20"


def test_no_inputs(server: ServerProcess) -> None:
    error = grpc_error(server.grpc, service_pb2.ModelInferRequest(model_name="tiny"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "the request has no inputs"


# -- back-pressure, deadlines, limits: the slow server ------------------------------------------
def requests_counted(server: ServerProcess, model: str, status: str) -> float:
    return metric(server, "scriptserve_requests_total", model=model, protocol="grpc", status=status)


async def _expiring(target: str, model: str, count: int, timeout_s: float) -> list[grpc.StatusCode]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            stub.ModelInfer(raw_request(model, X[:1]), timeout=timeout_s) for _ in range(count)
        ]
        return [await call.code() for call in calls]


async def _burst(target: str, model: str, count: int) -> list[tuple[grpc.StatusCode, Any]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def one(i: int) -> tuple[grpc.StatusCode, Any]:
            try:
                response = await stub.ModelInfer(
                    raw_request(model, X[i % 3 : i % 3 + 1]), timeout=30
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, response

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_full_queue_is_unavailable(slow_server: ServerProcess) -> None:
    results = asyncio.run(_burst(slow_server.grpc, "slow_q1", 10))
    codes = [code for code, _ in results]
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    for i, (code, value) in enumerate(results):
        if code == grpc.StatusCode.UNAVAILABLE:
            assert value == "the model's queue is full (1 requests waiting); retry later"
        else:
            out = np.frombuffer(value.raw_output_contents[0], "<f4").reshape(1, 3)
            np.testing.assert_allclose(out, reference_output(X[i % 3 : i % 3 + 1]), atol=1e-5)
    # Once the burst is over, the queue has room again.
    out = infer_ok(slow_server.grpc, "slow_q1", X[:1])
    np.testing.assert_allclose(out, reference_output(X[:1]), atol=1e-5)


def test_client_deadline_shorter_than_the_work(slow_server: ServerProcess) -> None:
    """The server's response timeout is 120 s; the client's deadline is what counts."""
    with triton.InferenceServerClient(slow_server.grpc) as client:
        tensor = triton.InferInput("x", [1, 8], "FP32")
        tensor.set_data_from_numpy(X[:1])
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as exc:
            client.infer("slow", [tensor], client_timeout=0.1)
        elapsed = time.monotonic() - started
    assert exc.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert elapsed < SLEEP_S + 0.5, elapsed
    assert pending_requests(slow_server, "slow") == 0


@pytest.mark.parametrize("timeout_s", [0.01, SLEEP_S / 2, 0.5])
def test_expired_calls_are_504s_and_log_no_error(
    slow_server: ServerProcess, timeout_s: float
) -> None:
    """Deadlines that pass before a call is queued, while it waits, and while it runs: the client
    gets DEADLINE_EXCEEDED on time, and the server counts those calls as 504s (never as 400, 499
    or 500) and logs no traceback for them."""
    statuses = ("400", "499", "500")
    before = {s: requests_counted(slow_server, "slow", s) for s in statuses}
    started = time.monotonic()
    codes = asyncio.run(_expiring(slow_server.grpc, "slow", 200, timeout_s))
    assert time.monotonic() - started < timeout_s + 1.0
    assert grpc.StatusCode.DEADLINE_EXCEEDED in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
    deadline = time.monotonic() + 10
    while pending_requests(slow_server, "slow") != 0:
        assert time.monotonic() < deadline, "expired calls still hold queue slots"
        time.sleep(0.05)
    assert {s: requests_counted(slow_server, "slow", s) for s in statuses} == before
    log = slow_server.output()
    assert "Traceback" not in log and "ExecuteBatchError" not in log, log[-3000:]


def test_message_over_the_size_limit(slow_server: ServerProcess) -> None:
    big = np.zeros((12_500, 8), dtype=np.float32)  # 100,000 floats: 400 kB
    error = grpc_error(slow_server.grpc, raw_request("slow", big))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX_MESSAGE_BYTES) in error.details()
    # A message within the limit is served.
    fits = np.full((1_000, 8), 0.25, dtype=np.float32)  # 32 kB
    np.testing.assert_allclose(
        infer_ok(slow_server.grpc, "slow", fits), reference_output(fits), atol=1e-5
    )


async def _start_and_cancel(server: ServerProcess) -> list[grpc.StatusCode]:
    async with grpc.aio.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            stub.ModelInfer(raw_request("slow", X[i % 3 : i % 3 + 1]), timeout=60)
            for i in range(CANCELLED_CALLS)
        ]
        # Cancel once most of them wait in the server's queue (a batch takes SLEEP_S).
        deadline = time.monotonic() + 20
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                r = await http.get(f"{server.mgmt}/models/slow", headers=server.mgmt_headers)
                if r.json()[0]["jobQueueStatus"]["pendingRequests"] >= CANCELLED_CALLS // 2:
                    break
                assert time.monotonic() < deadline, "the calls never queued up"
                await asyncio.sleep(0.02)
        for call in calls:
            call.cancel()
        return [await call.code() for call in calls]


def test_cancelled_calls_leave_nothing_behind(slow_server: ServerProcess) -> None:
    runs_before = metric(slow_server, "scriptserve_batch_size_sum", model="slow")
    counted_before = {s: requests_counted(slow_server, "slow", s) for s in ("499", "500")}
    codes = asyncio.run(_start_and_cancel(slow_server))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}, set(codes)
    cancelled = codes.count(grpc.StatusCode.CANCELLED)
    assert cancelled >= CANCELLED_CALLS // 2, cancelled

    deadline = time.monotonic() + 10
    while pending_requests(slow_server, "slow") != 0:
        assert time.monotonic() < deadline, "cancelled calls still hold queue slots"
        time.sleep(0.05)
    assert metric(slow_server, "scriptserve_queue_depth", model="slow") == 0
    # A new request is served, after at most the batch the worker had in hand.
    np.testing.assert_allclose(
        infer_ok(slow_server.grpc, "slow", X[:1]), reference_output(X[:1]), atol=1e-5
    )
    # Cancelled calls that were still queued never ran: besides the answered ones and the request
    # above, only the batches (of up to 32) the worker took while the cancels were arriving.
    ran = metric(slow_server, "scriptserve_batch_size_sum", model="slow") - runs_before
    answered = codes.count(grpc.StatusCode.OK)
    assert answered + 1 <= ran <= answered + 1 + 3 * MAX_BATCH, (ran, answered)
    # The server counts them as clients that went away (499), not as failures of its own.
    counted = {
        s: requests_counted(slow_server, "slow", s) - counted_before[s] for s in counted_before
    }
    assert counted["500"] == 0 and counted["499"] >= CANCELLED_CALLS // 2, counted
    assert slow_server.proc is not None and slow_server.proc.poll() is None
    log = slow_server.output()
    for sign in ("Traceback", "InvalidStateError", "was never retrieved"):
        assert sign not in log, log[-3000:]
