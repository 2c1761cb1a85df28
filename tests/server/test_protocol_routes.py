"""The inference routes answered by the HTTP protocol itself (server/rest/protocol_routes.py),
their one implementation whatever is switched on.

Two real servers of the same models, both with an inference key and a body limit: one as it
runs by default, one with the access log and tracing on (every request sampled, exported to a
real OTLP receiver). Each request gets the same answer from both, and the observed one writes
an access line and a span for each (KServe v1's route too, which FastAPI answers); what the
protocol does on a connection (withdrawing a request whose client left, pipelining,
`Expect: 100-continue`) is checked on raw sockets.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from otlp import GrpcReceiver
from serving import ServerProcess
from testmodels import SlowMLP, reference_output, save_torchscript

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.server.rest.protocol_routes import inference_route

# Slow: servers started for a few tests each.
pytestmark = pytest.mark.slow

KEY = "direct-routes-key"
MAX_BODY = 4096
AUTH = {"Authorization": f"Bearer {KEY}"}
ROW = [0.5] * 8
HEADER_LENGTH = "Inference-Header-Content-Length"


def _archive(store: Path, work: Path, name: str, model: Path) -> None:
    sample = work / "sample.json"
    sample.write_text(json.dumps(ROW))
    argv = [
        "--model-name",
        name,
        "--version",
        "1.0",
        "--serialized-file",
        str(model),
        "--handler",
        "tensor",
        "--sample-input",
        str(sample),
        "--export-path",
        str(store),
    ]
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("direct")
    store, work = root / "store", root / "work"
    work.mkdir()
    _archive(store, work, "tiny", save_torchscript(work / "tiny.pt"))
    _archive(store, work, "slow", save_torchscript(work / "slow.pt", SlowMLP(matmuls=400)))
    return store


def _start(store: Path, *args: str) -> ServerProcess:
    return ServerProcess(
        store,
        "--workers",
        "1",
        "--max-request-bytes",
        str(MAX_BODY),
        *args,
        env={"SCRIPTSERVE_INFERENCE_KEY": KEY, "OTEL_BSP_SCHEDULE_DELAY": "50"},
    ).start()


@pytest.fixture(scope="module")
def direct(store: Path) -> Iterator[ServerProcess]:
    proc = _start(store)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def receiver() -> Iterator[GrpcReceiver]:
    found = GrpcReceiver()
    yield found
    found.stop()


@dataclass
class Observed:
    server: ServerProcess
    access_log: Path
    receiver: GrpcReceiver


@pytest.fixture(scope="module")
def observed(store: Path, receiver: GrpcReceiver) -> Iterator[Observed]:
    access = store.parent / "access.log"
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--max-request-bytes",
        str(MAX_BODY),
        "--access-log",
        str(access),
        "--access-log-format",
        "json",
        "--tracing",
        "--tracing-endpoint",
        receiver.endpoint,
        "--tracing-protocol",
        "grpc",
        env={"SCRIPTSERVE_INFERENCE_KEY": KEY, "OTEL_BSP_SCHEDULE_DELAY": "50"},
    ).start()
    yield Observed(proc, access, receiver)
    proc.stop()


# -- which paths the protocol answers --------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/predictions/mnist", ("/predictions/{model_name}", "mnist", None)),
        ("/predictions/mnist/2.0", ("/predictions/{model_name}/{version}", "mnist", "2.0")),
        ("/v2/models/mnist/infer", ("/v2/models/{model_name}/infer", "mnist", None)),
        (
            "/v2/models/mnist/versions/3/infer",
            ("/v2/models/{model_name}/versions/{version}/infer", "mnist", "3"),
        ),
        # Left to FastAPI: empty segments, trailing slashes, other routes.
        ("/predictions/", None),
        ("/predictions/mnist/", None),
        ("/predictions//2.0", None),
        ("/predictions/mnist/2.0/extra", None),
        ("/v2/models//infer", None),
        ("/v2/models/mnist/3/infer", None),
        ("/v2/models/mnist/versions//infer", None),
        ("/v2/models/mnist/generate", None),
        ("/v2/models/infer", None),
    ],
)
def test_which_paths_are_inference_routes(
    path: str, expected: tuple[str, str, str | None] | None
) -> None:
    found = inference_route(path)
    if expected is None:
        assert found is None
        return
    assert found is not None
    route, name, version = found
    assert (route.template, name, version) == expected


def test_the_openapi_document_describes_the_inference_routes(direct: ServerProcess) -> None:
    paths = httpx.get(f"{direct.url}/openapi.json", headers=AUTH).json()["paths"]
    for path, methods in (
        ("/predictions/{model_name}", {"post", "put"}),
        ("/predictions/{model_name}/{version}", {"post", "put"}),
        ("/v2/models/{model_name}/infer", {"post"}),
        ("/v2/models/{model_name}/versions/{version}/infer", {"post"}),
    ):
        assert set(paths[path]) == methods, path
        params = {p["name"] for p in paths[path]["post"]["parameters"]}
        assert params == ({"model_name", "version"} if "{version}" in path else {"model_name"})
    assert "/v2/models/{model_name}/generate" in paths  # the app's own routes stay


def test_a_path_beside_the_inference_routes_is_not_found(direct: ServerProcess) -> None:
    r = httpx.post(f"{direct.url}/predictions/", json=ROW, headers=AUTH)
    assert r.status_code == 404
    assert r.json()["type"] == "RouteNotFound"


# -- the same answer either way -------------------------------------------------------------------
def _oip_binary() -> tuple[bytes, dict[str, str]]:
    raw = np.asarray([ROW], dtype="<f4").tobytes()
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [1, 8],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return head + raw, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


OIP_ROW = json.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": ROW}]})
JSON = {"Content-Type": "application/json"}
CASES: dict[str, tuple[str, str, bytes, dict[str, str]]] = {
    "predictions": ("POST", "/predictions/tiny", json.dumps(ROW).encode(), JSON),
    "predictions PUT, version": ("PUT", "/predictions/tiny/1.0", json.dumps(ROW).encode(), {}),
    "infer": ("POST", "/v2/models/tiny/infer", OIP_ROW.encode(), JSON),
    "infer binary, version": ("POST", "/v2/models/tiny/versions/1.0/infer", *_oip_binary()),
    "unknown model": ("POST", "/predictions/nope", b"[1]", JSON),
    "unknown model, OIP": ("POST", "/v2/models/nope/infer", OIP_ROW.encode(), JSON),
    "unknown version": ("POST", "/predictions/tiny/9", b"[1]", JSON),
    "empty body": ("POST", "/predictions/tiny", b"", JSON),
    "bad JSON": ("POST", "/v2/models/tiny/infer", b'{"inputs": [', JSON),
    "wrong shape": ("POST", "/predictions/tiny", b"[1, 2]", JSON),
    "bad timeout": ("POST", "/predictions/tiny", b"[1]", {"X-Request-Timeout": "soon"}),
    "no key": ("POST", "/v2/models/tiny/infer", OIP_ROW.encode(), {"Authorization": ""}),
    "wrong key": ("POST", "/predictions/tiny", b"[1]", {"Authorization": "Bearer nope"}),
    "too large": ("POST", "/predictions/tiny", b"[" + b"0," * MAX_BODY + b"0]", JSON),
    "multipart": ("POST", "/predictions/tiny", b"", {}),
    "no boundary": ("POST", "/predictions/tiny", b"x", {"Content-Type": "multipart/form-data"}),
    "GET": ("GET", "/predictions/tiny", b"", {}),
    "GET, OIP": ("GET", "/v2/models/tiny/versions/1.0/infer", b"", {}),
    # Served by the ASGI app (FastAPI), observed by the layer in front of it.
    "KServe v1": (
        "POST",
        "/v1/models/tiny:predict",
        json.dumps({"instances": [ROW]}).encode(),
        JSON,
    ),
    "KServe v1, bad body": ("POST", "/v1/models/tiny:predict", b'{"instances": 1}', JSON),
}
KSERVE_ROUTE = "/v1/models/{model_name}:predict"
ANSWER_HEADERS = ("date", "x-request-id", "traceparent")
"""What differs from one answer to the next, or is there only while observed."""


def _answer(
    server: ServerProcess, case: str, request_id: str | None = None
) -> tuple[int, dict[str, str], bytes, str | None]:
    method, path, body, headers = CASES[case]
    files = {"data": ("row.json", json.dumps(ROW).encode())} if case == "multipart" else None
    extra = {"X-Request-Id": request_id} if request_id else {}
    r = httpx.request(
        method,
        server.url + path,
        content=body or None,
        files=files,
        headers={**AUTH, **headers, **extra},
        timeout=30,
    )
    kept = {k: v for k, v in r.headers.items() if k not in ANSWER_HEADERS}
    return r.status_code, kept, r.content, r.headers.get("traceparent")


def _access_line(access_log: Path, request_id: str) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in access_log.read_text().splitlines() if access_log.exists() else ():
            if json.loads(line)["request_id"] == request_id:
                return dict(json.loads(line))
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}")


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_route_answers_alike_with_the_access_log_and_tracing_on(
    direct: ServerProcess, observed: Observed, case: str
) -> None:
    status, headers, body, untraced = _answer(direct, case)
    request_id = f"switch-{list(CASES).index(case)}"
    *answer, traceparent = _answer(observed.server, case, request_id)
    assert (status, headers, body) == tuple(answer)
    assert status in (200, 400, 401, 404, 405, 413)
    method, path = CASES[case][:2]
    line = _access_line(observed.access_log, request_id)
    assert (line["method"], line["path"], line["status"]) == (method, path, status)
    assert line["bytes"] == len(body)
    if status == 200:
        assert (line["model"], line["version"]) == ("tiny", "1.0")
    assert untraced is None and traceparent is not None
    spans = observed.receiver.trace(traceparent.split("-")[1], 1)
    (span,) = [s for s in spans if s.kind == "SERVER"]
    matched = inference_route(path)
    route = matched[0].template if matched is not None else KSERVE_ROUTE
    assert span.name == f"{method} {route}"
    assert span.attributes["http.route"] == route
    assert span.attributes["http.response.status_code"] == status
    if status == 200 and headers["content-type"] == "application/json":
        served = json.loads(body)
        if isinstance(served, list):
            values = served
        elif "predictions" in served:
            values = served["predictions"][0]
        else:
            values = served["outputs"][0]["data"]
        expected = reference_output(np.asarray([ROW], dtype=np.float32))[0]
        assert np.allclose(np.ravel(values), expected, atol=1e-5)
    elif status >= 400:
        error = json.loads(body)
        assert error.get("error") or error.get("message")


# -- only the protocol's path ----------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


class Reader:
    """HTTP/1.1 answers read off a raw socket one after another (Content-Length framed)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server")
        self.data += chunk

    def answer(self) -> Answer:
        while b"\r\n\r\n" not in self.data:
            self._more()
        head, _, self.data = self.data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers.get("content-length", "0"))
        while len(self.data) < length:
            self._more()
        body, self.data = self.data[:length], self.data[length:]
        return Answer(int(lines[0].split()[1]), headers, body)


def _request(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
        % (path.encode(), KEY.encode(), len(body), extra, body)
    )


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.ports[0]), timeout=30)


def test_pipelined_requests_are_answered_in_order(direct: ServerProcess) -> None:
    rows = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    requests = [
        _request("/predictions/tiny", json.dumps(rows[0].tolist()).encode()),
        _request("/v2/models/nope/infer", OIP_ROW.encode()),
        _request("/predictions/tiny/1.0", json.dumps(rows[1].tolist()).encode()),
        b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n",  # through the ASGI app, in its turn
    ]
    with _connect(direct) as sock:
        sock.sendall(b"".join(requests))
        reader = Reader(sock)
        answers = [reader.answer() for _ in requests]
    assert [a.status for a in answers] == [200, 404, 200, 200]
    expected = reference_output(rows)
    assert np.allclose(json.loads(answers[0].body), expected[0], atol=1e-5)
    assert json.loads(answers[1].body) == {"error": "model 'nope' is not registered"}
    assert np.allclose(json.loads(answers[2].body), expected[1], atol=1e-5)
    assert json.loads(answers[3].body) == {"status": "Healthy"}


def test_expect_100_continue(direct: ServerProcess) -> None:
    body = json.dumps(ROW).encode()
    head = _request("/predictions/tiny", b"", b"Expect: 100-continue\r\n")
    head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % len(body))
    with _connect(direct) as sock:
        sock.sendall(head)
        reader = Reader(sock)
        assert reader.answer().status == 100  # the head is accepted: send the body
        sock.sendall(body)
        answer = reader.answer()
    assert answer.status == 200
    expected = reference_output(np.asarray([ROW], dtype=np.float32))[0]
    assert np.allclose(json.loads(answer.body), expected, atol=1e-5)
    refused = head.replace(KEY.encode(), b"wrong")
    with _connect(direct) as sock:
        sock.sendall(refused)  # no 100 Continue: the key is refused before the body is sent
        assert Reader(sock).answer().status == 401
    no_deadline = head.replace(b"Expect:", b"X-Request-Timeout: soon\r\nExpect:")
    with _connect(direct) as sock:
        sock.sendall(no_deadline)  # nor for a deadline that is not a number of seconds
        answer = Reader(sock).answer()
    assert answer.status == 400
    assert b"X-Request-Timeout must be a positive number" in answer.body


def _requests_counted(server: ServerProcess, status: int) -> float:
    text = httpx.get(f"{server.metrics_url}/metrics").text
    prefix = 'scriptserve_requests_total{model="slow",protocol="rest",status="%d",version="1.0"}'
    for line in text.splitlines():
        if line.startswith(prefix % status):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_whose_client_left_is_withdrawn_before_it_runs(direct: ServerProcess) -> None:
    """The only worker is busy with one request; a second client sends its request and hangs
    up. The protocol withdraws it (counted 499) instead of running it for nobody."""
    answered, gone = _requests_counted(direct, 200), _requests_counted(direct, 499)
    busy: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: busy.append(
            httpx.post(f"{direct.url}/predictions/slow", json=ROW, headers=AUTH, timeout=60)
        )
    )
    worker.start()
    time.sleep(0.05)  # the first request is running
    with _connect(direct) as sock:
        sock.sendall(_request("/predictions/slow", json.dumps(ROW).encode()))
        time.sleep(0.05)  # queued behind it
    worker.join()
    assert busy[0].status_code == 200
    deadline = time.monotonic() + 10
    while _requests_counted(direct, 499) == gone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _requests_counted(direct, 499) - gone == 1
    time.sleep(0.5)  # had it run, it would have finished by now
    assert _requests_counted(direct, 200) - answered == 1
