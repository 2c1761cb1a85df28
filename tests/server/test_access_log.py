"""The access log and JSON logs against a real server: one line per HTTP request and gRPC call
with what operators look for (model, version, status, bytes, latency, request id, client), the
request id returned to the client and carried to the worker, refused calls logged too, and never
a key, a body or a query string in any log."""

from __future__ import annotations

import calendar
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tsprotos
from serving import ServerProcess
from testmodels import save_torchscript
from tritonclient.utils import InferenceServerException

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.server.observability.access_log import AccessLog, AccessRecord

INFERENCE_KEY = "inference-key-7f3a9c1e2b"
BODY_MARKER = 0.123456789
QUERY_SECRET = "query-secret-55d1"

PROBE_HANDLER = """
import logging

from scriptserve.handlers.tensor import TensorHandler

log = logging.getLogger("probe")


class Probe(TensorHandler):
    def inference(self, batch):
        log.info("handler saw request ids %s", ",".join(r.request_id for r in self.requests))
        return super().inference(batch)

    def preprocess(self, requests):
        self.requests = requests
        return super().preprocess(requests)
"""


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    work = tmp_path_factory.mktemp("access")
    store = work / "store"
    (work / "probe.py").write_text(PROBE_HANDLER)
    (work / "sample.json").write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", "tiny", "--version", "1.0", "--serialized-file",
        str(save_torchscript(work / "tiny.pt")), "--handler", str(work / "probe.py"),
        "--sample-input", str(work / "sample.json"), "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    access = work / "access.log"
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--access-log",
        str(access),
        "--access-log-format",
        "json",
        "--log-format",
        "json",
        "--enable-model-api",
        env={"SCRIPTSERVE_INFERENCE_KEY": INFERENCE_KEY},
    ).start()
    yield proc, access
    proc.stop()


def lines(access: Path, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The access log's JSON lines, once it has at least `count`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [json.loads(x) for x in access.read_text().splitlines()] if access.exists() else []
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def line_for(access: Path, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for line in lines(access, 0):
            if line["request_id"] == request_id:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}: {lines(access, 0)}")


KEY = {"Authorization": f"Bearer {INFERENCE_KEY}"}
ROW = [BODY_MARKER] + [0.5] * 7


def test_rest_requests_are_logged_with_their_id(logged: tuple[ServerProcess, Path]) -> None:
    server, access = logged
    r = httpx.post(
        f"{server.url}/predictions/tiny?token={QUERY_SECRET}",
        json=ROW,
        headers={**KEY, "X-Request-Id": "client-id-1"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "client-id-1"
    # The client's id names the request on the worker too (its record, handed to the worker).
    server.wait(lambda _: "handler saw request ids client-id-1" in server.output(), 10)
    line = line_for(access, "client-id-1")
    assert line["method"] == "POST" and line["path"] == "/predictions/tiny"
    assert (line["model"], line["version"], line["status"]) == ("tiny", "1.0", 200)
    assert line["bytes"] == len(r.content)
    assert line["protocol"] == "rest" and line["client"].startswith("127.0.0.1:")
    assert 0 < line["latency_ms"] < 10_000
    assert time.time() - time.mktime(time.strptime(line["time"][:19], "%Y-%m-%dT%H:%M:%S")) < (
        86_400  # a UTC timestamp of today (mktime reads it as local time)
    )


def test_a_request_without_an_id_gets_one_and_the_worker_sees_it(
    logged: tuple[ServerProcess, Path],
) -> None:
    server, access = logged
    r = httpx.post(
        f"{server.url}/v2/models/tiny/infer",
        headers=KEY,
        json={
            "inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": ROW}],
        },
    )
    assert r.status_code == 200, r.text
    made = r.headers["x-request-id"]
    assert len(made) >= 8
    assert line_for(access, made)["path"] == "/v2/models/tiny/infer"
    server.wait(lambda _: f"handler saw request ids {made}" in server.output(), 10)
    # A header id that is not plain visible ASCII is replaced, never logged.
    r = httpx.get(f"{server.url}/v2/models/tiny", headers={**KEY, "X-Request-Id": "a b"})
    assert r.status_code == 200 and r.headers["x-request-id"] != "a b"


def test_refused_and_failed_requests_are_logged(logged: tuple[ServerProcess, Path]) -> None:
    server, access = logged
    cases = [
        ({"X-Request-Id": "no-key"}, "/predictions/tiny", 401, "-"),
        ({**KEY, "X-Request-Id": "unknown"}, "/predictions/nope", 404, "nope"),
        ({**KEY, "X-Request-Id": "bad-row"}, "/predictions/tiny", 400, "tiny"),
    ]
    for headers, path, status, model in cases:
        r = httpx.post(f"{server.url}{path}", json=[1, 2], headers=headers)
        assert r.status_code == status, r.text
        line = line_for(access, headers["X-Request-Id"])
        assert (line["status"], line["model"], line["path"]) == (status, model, path)


def test_grpc_calls_are_logged_with_their_id(logged: tuple[ServerProcess, Path]) -> None:
    server, access = logged
    x = triton.InferInput("x", [1, 8], "FP32")
    x.set_data_from_numpy(np.array([ROW], np.float32))
    metadata = {"authorization": f"Bearer {INFERENCE_KEY}", "x-request-id": "grpc-id-1"}
    with triton.InferenceServerClient(server.grpc) as client:
        client.infer("tiny", [x], headers=metadata)
        with pytest.raises(InferenceServerException):
            client.infer("nope", [x], headers={**metadata, "x-request-id": "grpc-id-2"})
        with pytest.raises(InferenceServerException):
            client.infer("tiny", [x], headers={"x-request-id": "grpc-id-3"})
    ok = line_for(access, "grpc-id-1")
    assert ok["method"] == "gRPC" and ok["path"] == "/inference.GRPCInferenceService/ModelInfer"
    assert (ok["model"], ok["version"], ok["status"], ok["protocol"]) == (
        "tiny",
        "1.0",
        "OK",
        "grpc",
    )
    assert ok["bytes"] > 40 and ok["client"].startswith("127.0.0.1:")
    assert (line_for(access, "grpc-id-2")["status"], line_for(access, "grpc-id-2")["model"]) == (
        "NOT_FOUND",
        "nope",
    )
    assert line_for(access, "grpc-id-3")["status"] == "UNAUTHENTICATED"


def test_grpc_returns_the_request_id_in_trailing_metadata(
    logged: tuple[ServerProcess, Path],
) -> None:
    server, _ = logged
    torchserve_stubs = tsprotos.torchserve_stubs()
    request = torchserve_stubs.ts.PredictionsRequest(
        model_name="tiny", input={"data": json.dumps(ROW).encode()}
    )
    metadata = (("authorization", f"Bearer {INFERENCE_KEY}"), ("x-request-id", "ts-id-1"))
    with grpc.insecure_channel(server.grpc) as channel:
        stub = torchserve_stubs.ts_grpc.InferenceAPIsServiceStub(channel)
        _, call = stub.Predictions.with_call(request, metadata=metadata)
        assert dict(call.trailing_metadata())["x-request-id"] == "ts-id-1"
        missing = torchserve_stubs.ts.PredictionsRequest(model_name="nope", input={"data": b"1"})
        with pytest.raises(grpc.RpcError) as exc:
            stub.Predictions(missing, metadata=(metadata[0], ("x-request-id", "ts-id-2")))
        assert dict(exc.value.trailing_metadata())["x-request-id"] == "ts-id-2"


def test_no_key_body_or_query_string_reaches_any_log(logged: tuple[ServerProcess, Path]) -> None:
    server, access = logged
    r = httpx.post(f"{server.url}/predictions/tiny?token={QUERY_SECRET}", json=ROW, headers=KEY)
    assert r.status_code == 200
    line_for(access, r.headers["x-request-id"])
    everything = access.read_text() + server.output()
    for secret in (INFERENCE_KEY, server.management_key, str(BODY_MARKER), QUERY_SECRET):
        assert secret not in everything


def test_server_logs_are_json_lines(logged: tuple[ServerProcess, Path]) -> None:
    server, _ = logged
    records = [json.loads(line) for line in server.output().splitlines() if line.strip()]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["logger"] == "probe" for r in records)  # worker lines too


def test_plain_lines_are_single_lines(tmp_path: Path) -> None:
    # Written together with clean lines, the forged one is escaped and they are left as they are.
    access = AccessLog(str(tmp_path / "access.log"), "plain")
    paths = ["/v2/models/a", "/v2/models/a\nFORGED 200", "/v2/models/\u00e9t\u00e9\x1b[2J"]
    try:
        for i, path in enumerate(paths):
            record = AccessRecord("GET", path, "127.0.0.1:1", "rest", f"id-{i}")
            record.finish(404)
            access.write(record)
    finally:
        access.close()
    lines = (tmp_path / "access.log").read_text().splitlines()
    assert len(lines) == 3 and all("status=404" in line for line in lines), lines
    assert '"GET /v2/models/a" rest' in lines[0]
    assert '"GET /v2/models/a\\nFORGED 200" rest' in lines[1]
    assert '"GET /v2/models/\u00e9t\u00e9\\x1b[2J" rest' in lines[2]


def test_a_line_shows_when_its_request_ended_and_how_long_it_took(tmp_path: Path) -> None:
    # The record keeps two readings of one clock and the client's address as the transport has
    # it; the writer makes the wall-clock time, the latency and the address's text of them.
    access = AccessLog(str(tmp_path / "access.log"), "json")
    try:
        record = AccessRecord("POST", "/predictions/tiny", ("192.0.2.1", 5000), "rest", "timed")
        time.sleep(0.05)
        before = time.time()
        record.finish(200)
        after = time.time()
        access.write(record)
    finally:
        access.close()
    line = json.loads((tmp_path / "access.log").read_text())
    shown = calendar.timegm(time.strptime(line["time"][:19], "%Y-%m-%dT%H:%M:%S"))
    shown += int(line["time"][20:23]) / 1000
    assert line["time"].endswith("Z") and before - 0.002 <= shown <= after + 0.002, line
    assert 50 <= line["latency_ms"] < 5_000 and line["client"] == "192.0.2.1:5000"


def test_a_loopback_proxys_forwarded_client_is_logged(logged: tuple[ServerProcess, Path]) -> None:
    # A sidecar or proxy on loopback names the real client; the inference routes, served below
    # FastAPI, log it as the other routes do.
    server, access = logged
    forwarded = {**KEY, "X-Forwarded-For": "203.0.113.7"}
    for i, path in enumerate(("/predictions/tiny", "/v2/models/tiny")):
        request_id = f"forwarded-{i}"
        if path.startswith("/predictions"):
            r = httpx.post(
                server.url + path, json=ROW, headers={**forwarded, "X-Request-Id": request_id}
            )
        else:
            r = httpx.get(server.url + path, headers={**forwarded, "X-Request-Id": request_id})
        assert r.status_code == 200, r.text
        assert line_for(access, request_id)["client"] == "203.0.113.7:0"


def test_lines_reach_the_file_whole_and_in_order_within_the_flush_interval(tmp_path: Path) -> None:
    # Lines are gathered and written together (every 100 ms or 512 lines), never one system call
    # a request: none may be split, reordered, or wait for the log to close.
    path = tmp_path / "access.log"
    access = AccessLog(str(path), "json")
    try:
        count = 2000  # over 512 lines: some writes are made by count, the rest by time
        for i in range(count):
            record = AccessRecord("POST", "/predictions/tiny", "127.0.0.1:1", "rest", f"id-{i}")
            record.finish(200)
            access.write(record)
        deadline = time.monotonic() + 2.0
        found: list[str] = []
        while time.monotonic() < deadline:
            found = path.read_text().splitlines()
            if len(found) == count:
                break
            time.sleep(0.02)
        assert [json.loads(line)["request_id"] for line in found] == [
            f"id-{i}" for i in range(count)
        ]
    finally:
        access.close()
