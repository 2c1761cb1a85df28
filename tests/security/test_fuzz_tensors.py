"""Property-based fuzzing of tensor requests against a real server, over every way a tensor
arrives: OIP JSON, the binary extension, gRPC typed and raw contents, and a gRPC stream.

Shapes, datatypes and values are drawn from the extremes a hostile client would send
(dimensions of 2**63-1, booleans as dimensions, integers as BYTES elements, lying byte sizes).
Every answer must be a success or a client error with a plain message: never a 5xx, UNKNOWN or
INTERNAL, never a path or a traceback; the server logs no traceback, still answers a normal
request correctly, and its memory and open files stay bounded. Thread and process workers are
both served, so nothing invalid may reach a worker's shared memory either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import psutil
import pytest
from hardening import LEAK, archive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import ServerProcess
from testmodels import reference_output
from tritonclient.grpc import service_pb2, service_pb2_grpc

# Slow: fuzzing.
pytestmark = pytest.mark.slow

MODELS = ("tiny", "tiny_proc")
DATATYPES = ["FP32", "FP64", "FP16", "BF16", "INT8", "INT64", "UINT8", "BOOL", "BYTES", "FP99", ""]
EXTREME_DIMS = [0, 1, 2, 7, 8, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1]
MAX_RSS_GROWTH_MB = 150
MAX_FD_GROWTH = 16
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same cases on every run: a failure is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

dims = st.one_of(st.sampled_from(EXTREME_DIMS), st.integers(0, 16))
json_dims = st.one_of(dims, st.sampled_from([-1, True, False, 1.5, "8", None, [1]]))
shapes = st.lists(dims, min_size=0, max_size=4)
json_shapes = st.one_of(st.lists(json_dims, max_size=4), st.sampled_from([None, "8", 8, {}]))
scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(-(2**70), 2**70),
    st.sampled_from([1099511627776, 300000000, True, None, "a", "", {}, []]),
    st.text(max_size=8),
)
values = st.one_of(
    st.lists(scalars, max_size=24), st.lists(st.lists(scalars, max_size=8), max_size=3)
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("fuzz_tensors")
    store = root / "store"
    archive(store, root / "work", "tiny")
    archive(store, root / "work", "tiny_proc", config={"workerMode": "process"})
    proc = ServerProcess(store, "--workers", "1").start()
    yield proc
    proc.stop()


def _tree(server: ServerProcess) -> list[psutil.Process]:
    assert server.proc is not None
    main = psutil.Process(server.proc.pid)
    return [main, *main.children(recursive=True)]


def _rss_mb(server: ServerProcess) -> float:
    return sum(p.memory_info().rss for p in _tree(server)) / 2**20


def _fds(server: ServerProcess) -> int:
    return sum(p.num_fds() for p in _tree(server))


def _still_serves(server: ServerProcess) -> None:
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    for model in MODELS:
        body = {
            "inputs": [
                {"name": "x", "shape": [2, 8], "datatype": "FP32", "data": x.ravel().tolist()}
            ]
        }
        r = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)
        assert r.status_code == 200, r.text
        got = np.array(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, 3)
        np.testing.assert_allclose(got, reference_output(x), atol=1e-5)


def _assert_client_error(status: int, text: str) -> None:
    assert status < 500, text
    if status != 200:
        assert status in (400, 404, 413), text
        assert not LEAK.search(text), text


@pytest.fixture(scope="module")
def baseline(server: ServerProcess) -> tuple[float, int]:
    _still_serves(server)
    return _rss_mb(server), _fds(server)


@FUZZ
@given(
    model=st.sampled_from(MODELS),
    name=st.sampled_from(["x", "x", "z", ""]),
    datatype=st.sampled_from(DATATYPES),
    shape=json_shapes,
    data=values,
    twice=st.booleans(),
)
def test_oip_json(
    server: ServerProcess,
    baseline: tuple[float, int],
    model: str,
    name: str,
    datatype: str,
    shape: Any,
    data: Any,
    twice: bool,
) -> None:
    tensor = {"name": name, "datatype": datatype, "shape": shape, "data": data}
    body = {"inputs": [tensor, tensor] if twice else [tensor]}
    r = httpx.post(f"{server.url}/v2/models/{model}/infer", content=json.dumps(body), timeout=30)
    _assert_client_error(r.status_code, r.text)


@FUZZ
@given(
    model=st.sampled_from(MODELS),
    datatype=st.sampled_from(DATATYPES),
    shape=shapes,
    blob=st.binary(max_size=96),
    declared=st.one_of(st.integers(-4, 200), st.sampled_from([2**63, 10**30, True, "8"])),
    header_length=st.sampled_from(["exact", "²", "-1", "1e3", "", "99999999999999999999"]),
)
def test_oip_binary(
    server: ServerProcess,
    baseline: tuple[float, int],
    model: str,
    datatype: str,
    shape: list[int],
    blob: bytes,
    declared: Any,
    header_length: str,
) -> None:
    spec = {
        "name": "x",
        "datatype": datatype,
        "shape": shape,
        "parameters": {"binary_data_size": declared},
    }
    header = json.dumps({"inputs": [spec]}).encode()
    length = str(len(header)) if header_length == "exact" else header_length
    r = httpx.post(
        f"{server.url}/v2/models/{model}/infer",
        content=header + blob,
        headers={"Inference-Header-Content-Length": length.encode()},
        timeout=30,
    )
    _assert_client_error(r.status_code, r.text)


def _grpc_request(
    model: str, datatype: str, shape: list[int], raw: bytes | None, typed: Any
) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model, id="fuzz")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    else:
        kind, items = typed
        getattr(tensor.contents, kind).extend(items)
    return request


typed_contents = st.one_of(
    st.tuples(st.just("fp32_contents"), st.lists(st.floats(width=32), max_size=24)),
    st.tuples(st.just("int64_contents"), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=24)),
    st.tuples(st.just("bytes_contents"), st.lists(st.binary(max_size=8), max_size=24)),
    st.tuples(st.just("bool_contents"), st.lists(st.booleans(), max_size=24)),
)


@FUZZ
@given(
    model=st.sampled_from(MODELS),
    datatype=st.sampled_from(DATATYPES),
    shape=st.lists(st.one_of(dims, st.integers(-(2**63), -1)), max_size=4),
    raw=st.one_of(st.none(), st.binary(max_size=96)),
    typed=typed_contents,
)
def test_grpc_infer(
    server: ServerProcess,
    baseline: tuple[float, int],
    model: str,
    datatype: str,
    shape: list[int],
    raw: bytes | None,
    typed: Any,
) -> None:
    request = _grpc_request(model, datatype, shape, raw, typed)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as error:
            assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (
                error.code(),
                error.details(),
            )
            assert not LEAK.search(error.details() or "")


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    bad=st.lists(
        st.tuples(st.sampled_from(DATATYPES), st.lists(dims, max_size=3), st.binary(max_size=40)),
        min_size=1,
        max_size=6,
    ),
)
def test_grpc_stream_fails_only_the_bad_messages(
    server: ServerProcess, baseline: tuple[float, int], bad: list[tuple[str, list[int], bytes]]
) -> None:
    x = np.full((1, 8), 0.5, dtype=np.float32)
    good = _grpc_request("tiny", "FP32", [1, 8], x.tobytes(), None)
    good.id = "good"
    requests = []
    for i, (datatype, shape, raw) in enumerate(bad):
        request = _grpc_request("tiny", datatype, shape, raw, None)
        request.id = f"bad-{i}"
        requests += [request, good]
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        replies = list(stub.ModelStreamInfer(iter(requests), timeout=60))
    assert len(replies) == len(requests)
    for reply in replies:
        if reply.error_message:
            assert not LEAK.search(reply.error_message)
            continue
        assert reply.infer_response.id in {"good", *(r.id for r in requests)}
        if reply.infer_response.id == "good":
            out = np.frombuffer(reply.infer_response.raw_output_contents[0], "<f4")
            np.testing.assert_allclose(out, reference_output(x)[0], atol=1e-5)
    answered_good = [r for r in replies if r.infer_response.id == "good" and not r.error_message]
    assert len(answered_good) == len(bad)


def test_bytes_numbers_and_huge_shapes_never_reach_a_worker(server: ServerProcess) -> None:
    """The cases that once answered 500 or grew a process worker by a gigabyte."""
    cases = [
        {"name": "x", "shape": [0, 9223372036854775808], "datatype": "FP32", "data": []},
        {"name": "x", "shape": [True, 16], "datatype": "FP32", "data": [0.5] * 16},
        {"name": "x", "shape": [3], "datatype": "BYTES", "data": [300000000] * 3},
        {"name": "x", "shape": [1], "datatype": "BYTES", "data": [1099511627776]},
    ]
    for model in MODELS:
        before = _rss_mb(server)
        for tensor in cases:
            r = httpx.post(f"{server.url}/v2/models/{model}/infer", json={"inputs": [tensor]})
            assert r.status_code == 400, r.text
            assert not LEAK.search(r.text)
        assert _rss_mb(server) - before < 50
    request = _grpc_request("tiny", "FP32", [0, 2**63 - 1], b"", None)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "dimension is larger than" in (info.value.details() or "")


def test_after_the_fuzzing(server: ServerProcess, baseline: tuple[float, int]) -> None:
    """Last in the module: the server still serves correctly, logged no traceback, and its
    memory and open files came back within bounds."""
    _still_serves(server)
    rss, fds = baseline
    assert _rss_mb(server) - rss < MAX_RSS_GROWTH_MB
    assert _fds(server) - fds <= MAX_FD_GROWTH
    log = Path(server.log).read_text()
    assert "Traceback" not in log, log[-3000:]
