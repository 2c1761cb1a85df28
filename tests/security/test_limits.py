"""Body limits on every route (honest, lying and absent Content-Length, 100k tiny chunks),
multipart limits, and the gRPC message limit; no error body leaks anything."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from hardening import assert_no_leak
from serving import ServerProcess
from tritonclient.grpc import service_pb2, service_pb2_grpc

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

LIMIT = 65536


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        store,
        "--enable-model-api",
        "--workers",
        "1",
        env={
            "SCRIPTSERVE_MAX_REQUEST_BYTES": str(LIMIT),
            "SCRIPTSERVE_GRPC_MAX_MESSAGE_BYTES": str(LIMIT),
            "SCRIPTSERVE_MAX_MULTIPART_FILES": "2",
            "SCRIPTSERVE_MAX_MULTIPART_FIELDS": "4",
            "SCRIPTSERVE_MAX_MULTIPART_PART_BYTES": "2048",
        },
    ).start()
    yield proc
    proc.stop()


def routes(server: ServerProcess) -> list[tuple[str, dict[str, str]]]:
    return [
        (f"{server.url}/predictions/tiny", {}),
        (f"{server.url}/v2/models/tiny/infer", {}),
        (f"{server.url}/nope", {}),
        (f"{server.mgmt}/models?url=tiny.mar", server.mgmt_headers),
        (f"{server.metrics_url}/metrics", {}),
    ]


def alive(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/tiny", json=[0.5] * 8)
    assert r.status_code == 200, r.text


def test_honest_content_length_over_the_limit(server: ServerProcess) -> None:
    body = b"x" * (LIMIT + 1)
    for url, headers in routes(server):
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 413, (url, r.text)
        assert str(LIMIT) in r.text
        assert_no_leak(r)
    alive(server)


def test_chunked_body_over_the_limit(server: ServerProcess) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(64):
            yield b"y" * 4096  # 256 KiB in all, no Content-Length

    for url, headers in routes(server)[:2]:
        r = httpx.post(url, content=chunks(), headers=headers)
        assert r.status_code == 413, (url, r.text)
        assert_no_leak(r)
    alive(server)


def raw_request(server: ServerProcess, head: bytes, body_parts: Iterator[bytes]) -> bytes:
    """Send a hand-made request; return whatever the server answers before closing."""
    port = server.ports[0]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: what it said is what counts
        sock.settimeout(30)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and len(answer) > 4096:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return answer


def test_lying_content_length(server: ServerProcess) -> None:
    """A Content-Length smaller than the body: the server reads only what was declared; the rest
    never becomes part of this request's body (it is a malformed next request, refused)."""
    head = (
        b"POST /predictions/tiny HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\n\r\n"
    )
    answer = raw_request(server, head, iter([b"[0.5, 0.5," + b"9" * (4 * LIMIT)]))
    status = answer.split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 4"), answer[:200]
    assert b"Traceback" not in answer
    alive(server)


def test_100k_one_byte_chunks(server: ServerProcess) -> None:
    head = (
        b"POST /predictions/tiny HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    parts = (b"1\r\n \r\n" for _ in range(100_000))
    answer = raw_request(server, head, iter([b"".join(parts) + b"0\r\n\r\n"]))
    status = answer.split(b"\r\n", 1)[0]
    assert status in (b"HTTP/1.1 413 Request Entity Too Large", b"HTTP/1.1 400 Bad Request"), (
        answer[:300]
    )
    alive(server)


def test_multipart_limits(server: ServerProcess) -> None:
    url = f"{server.url}/predictions/tiny"
    too_many_files = [("f", (f"{i}.bin", b"1", "application/octet-stream")) for i in range(3)]
    too_many_fields = {f"k{i}": "1" for i in range(5)}
    big_field = {"data": "x" * 4096}
    for kwargs in (
        {"files": too_many_files},
        {"data": too_many_fields, "files": {"x": ("a", b"1")}},
        {"data": big_field, "files": {"x": ("a", b"1")}},
    ):
        r = httpx.post(url, **kwargs)  # type: ignore[arg-type]
        assert r.status_code in (400, 413), r.text
        assert_no_leak(r)
    alive(server)


def test_grpc_message_over_the_limit(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="tiny")
        rows = LIMIT // 32 + 1
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[rows, 8])
        tensor.contents.fp32_contents.extend(np.zeros(rows * 8, np.float32).tolist())
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, timeout=30)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "/tmp" not in (exc.value.details() or "")
    alive(server)
