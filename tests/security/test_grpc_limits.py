"""gRPC: a request that is not a valid protobuf message is INVALID_ARGUMENT with a plain message
(in a stream only that message fails), and the connection limits from the settings are in
effect: calls beyond max_concurrent_streams wait, too-frequent pings end the connection, an
idle connection is closed by the server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from serving import ServerProcess
from testmodels import reference_output
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tsprotos import torchserve_stubs

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

OIP = "/inference.GRPCInferenceService"
TS = "/org.pytorch.serve.grpc.inference.InferenceAPIsService"
MALFORMED = b"\x0a\x10tiny"
"""Field 1 (a string) that says 16 bytes follow, and then 4: not a valid message of any kind."""
MAX_STREAMS = 2
IDLE_S = 1.0


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        env={
            "SCRIPTSERVE_GRPC_MAX_CONCURRENT_STREAMS": str(MAX_STREAMS),
            "SCRIPTSERVE_GRPC_KEEPALIVE_MAX_PING_STRIKES": "1",
            "SCRIPTSERVE_GRPC_MAX_CONNECTION_IDLE_S": str(IDLE_S),
        },
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def ts() -> SimpleNamespace:
    return torchserve_stubs()


def raw(channel: grpc.Channel, method: str, deserialize: Callable[[bytes], Any]) -> Any:
    """A unary-unary callable that sends the bytes it is given as they are."""
    return channel.unary_unary(
        method, request_serializer=lambda b: b, response_deserializer=deserialize
    )


def infer_request(request_id: str) -> Any:
    x = np.full((1, 8), 0.5, np.float32)
    request = service_pb2.ModelInferRequest(model_name="tiny", id=request_id)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 8])
    request.raw_input_contents.append(x.tobytes())
    return request


def assert_quiet_log(server: ServerProcess) -> None:
    log = server.output()
    for word in ("Traceback", "DecodeError", "Unexpected", "Error parsing"):
        assert word not in log, log[-3000:]


def test_a_malformed_request_is_invalid_argument_with_a_plain_message(
    server: ServerProcess, ts: SimpleNamespace
) -> None:
    cases = [
        (f"{OIP}/ModelInfer", "ModelInferRequest", service_pb2.ModelInferResponse.FromString),
        (f"{TS}/Predictions", "PredictionsRequest", ts.ts.PredictionResponse.FromString),
    ]
    with grpc.insecure_channel(server.grpc) as channel:
        for method, message, deserialize in cases:
            with pytest.raises(grpc.RpcError) as exc:
                raw(channel, method, deserialize)(MALFORMED, timeout=10)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert exc.value.details() == f"the request is not a valid {message} message"
        stream = channel.unary_stream(
            f"{TS}/StreamPredictions",
            request_serializer=lambda b: b,
            response_deserializer=ts.ts.PredictionResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as exc:
            list(stream(MALFORMED, timeout=10))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details() == "the request is not a valid PredictionsRequest message"
        # The server goes on serving valid requests.
        reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            infer_request("ok"), timeout=10
        )
        assert reply.id == "ok"
    assert_quiet_log(server)


def test_a_malformed_message_in_a_stream_fails_alone(
    server: ServerProcess, ts: SimpleNamespace
) -> None:
    expected = reference_output(np.full((1, 8), 0.5, np.float32))[0]
    messages = [
        infer_request("a").SerializeToString(),
        MALFORMED,
        infer_request("c").SerializeToString(),
    ]
    with grpc.insecure_channel(server.grpc) as channel:
        stream = channel.stream_stream(
            f"{OIP}/ModelStreamInfer",
            request_serializer=lambda b: b,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        replies = list(stream(iter(messages), timeout=30))
        assert len(replies) == 3
        failed = [r for r in replies if r.error_message]
        assert [r.error_message for r in failed] == [
            "the request is not a valid ModelInferRequest message"
        ]
        answered = {r.infer_response.id: r.infer_response for r in replies if not r.error_message}
        assert set(answered) == {"a", "c"}
        for response in answered.values():
            out = np.frombuffer(response.raw_output_contents[0], "<f4")
            np.testing.assert_allclose(out, expected, atol=1e-5)

        # TorchServe's bidirectional stream: in order, the bad one with INVALID_ARGUMENT.
        good = ts.ts.PredictionsRequest(
            model_name="tiny", input={"data": json.dumps([0.5] * 8).encode()}
        )
        predictions = channel.stream_stream(
            f"{TS}/StreamPredictions2",
            request_serializer=lambda b: b,
            response_deserializer=ts.ts.PredictionResponse.FromString,
        )
        good_bytes = good.SerializeToString()
        responses = list(predictions(iter([good_bytes, MALFORMED, good_bytes]), timeout=30))
        assert len(responses) == 3
        assert responses[1].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert responses[1].status.message == (
            "the request is not a valid PredictionsRequest message"
        )
        for ok in (responses[0], responses[2]):
            assert not ok.HasField("status")
            np.testing.assert_allclose(json.loads(ok.prediction), expected, atol=1e-5)
    assert_quiet_log(server)


def test_calls_beyond_the_concurrent_streams_limit_wait_for_one_to_end(
    server: ServerProcess,
) -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(server.grpc) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            live = service_pb2.ServerLiveRequest()
            assert (await stub.ServerLive(live, timeout=10)).live
            streams = [stub.ModelStreamInfer() for _ in range(MAX_STREAMS)]
            for stream in streams:
                await stream.wait_for_connection()
            # A third call on this connection waits (gRPC queues it) until its deadline ...
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.ServerLive(live, timeout=1.0)
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # ... while another connection is served (channels share connections unless told
            # not to), and it runs once a stream has ended.
            own = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(server.grpc, options=own) as other:
                other_stub = service_pb2_grpc.GRPCInferenceServiceStub(other)
                assert (await other_stub.ServerLive(live, timeout=10)).live
            await streams[0].done_writing()
            assert [reply async for reply in streams[0]] == []
            assert (await stub.ServerLive(live, timeout=10)).live
            await streams[1].done_writing()
            assert [reply async for reply in streams[1]] == []

    asyncio.run(run())


def test_pings_faster_than_the_server_allows_end_the_connection(server: ServerProcess) -> None:
    options = [
        ("grpc.keepalive_time_ms", 100),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]

    async def run() -> None:
        async with grpc.aio.insecure_channel(server.grpc, options=options) as channel:
            stream = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
            await stream.wait_for_connection()
            # No message flows; the client pings every 100 ms: the server ends the connection.
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await asyncio.wait_for(stream.read(), 30)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert exc.value.details() == "Too many pings"

    asyncio.run(run())


def test_an_idle_connection_is_closed_by_the_server(server: ServerProcess) -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(server.grpc) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert (await stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10)).live
            assert channel.get_state() == grpc.ChannelConnectivity.READY
            loop = asyncio.get_running_loop()
            began = loop.time()
            await asyncio.wait_for(
                channel.wait_for_state_change(grpc.ChannelConnectivity.READY), IDLE_S + 10
            )
            waited = loop.time() - began
            # The server's GOAWAY turns the channel IDLE (its own idle timeout is 30 min).
            assert channel.get_state() == grpc.ChannelConnectivity.IDLE
            assert IDLE_S * 0.5 <= waited <= IDLE_S + 5, waited
            # The next call connects again.
            assert (await stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10)).live

    asyncio.run(run())
