"""Profiling on demand against a real server: a torch.profiler trace of one model version's next
batches over the REST and gRPC management APIs, for thread and process workers, while the
model goes on serving; one capture per model at a time; the management key; clear errors."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from serving import ServerProcess
from tsprotos import torchserve_stubs

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

ROW = [0.5] * 8
TORCHSCRIPT_OPS = {"aten::linear", "aten::addmm", "aten::relu"}


class Load:
    """Requests sent one after another from a thread until stopped, each with its own id."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.statuses: list[int] = []
        self.ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                request_id = f"load-{self.model}-{len(self.ids)}"
                self.ids.append(request_id)
                reply = client.post(
                    f"{self.url}/predictions/{self.model}",
                    json=ROW,
                    headers={"X-Request-Id": request_id},
                )
                self.statuses.append(reply.status_code)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def batch_ranges(trace: dict[str, Any], model: str) -> list[dict[str, Any]]:
    return [e for e in events(trace) if e["name"].startswith(f"batch {model}:1.0 x")]


@pytest.fixture(scope="module")
def grpc_management(server: ServerProcess) -> Iterator[Any]:
    # The project's management proto compiled as a client would (tsprotos.py): importing
    # server/grpc/_generated here would clash with it in protobuf's default pool.
    with grpc.insecure_channel(server.grpc_mgmt) as channel:
        yield torchserve_stubs().mgmt_grpc.ManagementAPIsServiceStub(channel)


def key(server: ServerProcess) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {server.management_key}"),)


def test_thread_workers_trace_over_rest_while_serving(server: ServerProcess) -> None:
    with Load(server.url, "tiny") as load:
        reply = httpx.post(
            f"{server.mgmt}/models/tiny/profile",
            params={"batches": 5, "record_shapes": "true"},
            headers=server.mgmt_headers,
            timeout=90,
        )
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-encoding"] == "gzip"  # httpx asked for it, and decoded it
    name = reply.headers["content-disposition"].split("filename=")[1].strip('"')
    assert name.startswith("tiny-1.0-") and name.endswith(".pt.trace.json")
    assert reply.headers["x-profile-batches"] == "5"
    trace = reply.json()
    assert trace["otherData"]["batches"] == 5 and trace["otherData"]["model"] == "tiny"

    batches = batch_ranges(trace, "tiny")
    assert len(batches) == 5
    for batch in batches:  # `batch tiny:1.0 x<size> [<request ids>]`
        size, ids = batch["name"].removeprefix("batch tiny:1.0 x").split(" ", 1)
        assert len(ids.strip("[]").split(",")) == int(size) >= 1
    # Under each batch, on its worker's thread, the TorchScript model's operators.
    worker_tids = {b["tid"] for b in batches}
    ops = {e["name"] for e in events(trace) if e["tid"] in worker_tids}
    assert ops & TORCHSCRIPT_OPS, sorted(ops)[:20]
    assert any("Input Dims" in e.get("args", {}) for e in events(trace))  # record_shapes
    # Only this model's worker threads, named as the server names them.
    assert {e["tid"] for e in events(trace) if isinstance(e["tid"], int)} <= worker_tids
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names and all(n.startswith("thread-worker-tiny-1.0-") for n in names), names
    # Serving went on during the capture, and nothing failed.
    assert len(load.statuses) > 5 and set(load.statuses) == {200}


def test_uncompressed_when_the_client_does_not_take_gzip(server: ServerProcess) -> None:
    with Load(server.url, "tiny"):
        reply = httpx.post(
            f"{server.mgmt}/models/tiny/1.0/profile",
            params={"batches": 2},
            headers={**server.mgmt_headers, "Accept-Encoding": "identity"},
            timeout=90,
        )
    assert reply.status_code == 200 and "content-encoding" not in reply.headers
    assert len(batch_ranges(json.loads(reply.content), "tiny")) == 2


def test_one_capture_per_model_and_one_per_process_for_thread_workers(
    server: ServerProcess,
) -> None:
    """No traffic: the first capture waits its 3 s and ends with no batch; meanwhile a second
    capture of the same model, or of another thread-worker model, is refused with 409."""
    first: list[httpx.Response] = []
    waiting = threading.Thread(
        target=lambda: first.append(
            httpx.post(
                f"{server.mgmt}/models/tiny/profile",
                params={"seconds": 3},
                headers=server.mgmt_headers,
                timeout=60,
            )
        )
    )
    waiting.start()
    try:
        server.wait(lambda _: "for at most 3 s" in server.output(), timeout_s=10)  # it runs
        refused = httpx.post(
            f"{server.mgmt}/models/tiny/profile",
            params={"seconds": 0.05},
            headers=server.mgmt_headers,
        )
        assert refused.status_code == 409
        assert "being captured" in refused.json()["message"]
        other = httpx.post(
            f"{server.mgmt}/models/tiny_onnx/profile",
            params={"seconds": 0.05},
            headers=server.mgmt_headers,
        )
        assert other.status_code == 409
        assert "one at a time for thread workers" in other.json()["message"]
    finally:
        waiting.join(30)
    assert first[0].status_code == 200
    assert first[0].headers["x-profile-batches"] == "0"
    # It waited out its 3 s (the event loop's timer may fire a millisecond early).
    assert float(first[0].headers["x-profile-seconds"]) >= 2.99
    assert batch_ranges(first[0].json(), "tiny") == []


def test_process_workers_trace_over_grpc(server: ServerProcess, grpc_management: Any) -> None:
    params = {
        "url": "tiny.mar", "model_name": "tiny_proc", "worker_mode": "process",
        "initial_workers": "1", "synchronous": "true",
    }  # fmt: skip
    registered = httpx.post(
        f"{server.mgmt}/models", params=params, headers=server.mgmt_headers, timeout=120
    )
    assert registered.status_code == 200, registered.text
    try:
        (described,) = httpx.get(
            f"{server.mgmt}/models/tiny_proc", headers=server.mgmt_headers
        ).json()
        (worker,) = described["workers"]
        with Load(server.url, "tiny_proc") as load:
            answer = grpc_management.ProfileModel(
                torchserve_stubs().mgmt.ProfileModelRequest(model_name="tiny_proc", batches=3),
                metadata=key(server),
                timeout=90,
            )
        assert answer.batches == 3 and answer.file_name.startswith("tiny_proc-1.0-")
        trace = json.loads(gzip.decompress(answer.trace))
        batches = batch_ranges(trace, "tiny_proc")
        assert batches and {b["pid"] for b in batches} == {worker["pid"]}  # the worker process
        ops = {e["name"] for e in events(trace) if e["pid"] == worker["pid"]}
        assert ops & TORCHSCRIPT_OPS
        assert set(load.statuses) == {200}
        # The worker's profiler was stopped: a second capture starts and ends as the first.
        again = grpc_management.ProfileModel(
            torchserve_stubs().mgmt.ProfileModelRequest(model_name="tiny_proc", seconds=0.2),
            metadata=key(server),
            timeout=90,
        )
        assert again.batches == 0
    finally:
        httpx.delete(f"{server.mgmt}/models/tiny_proc", headers=server.mgmt_headers, timeout=60)


def test_profiling_takes_the_management_key(server: ServerProcess, grpc_management: Any) -> None:
    reply = httpx.post(f"{server.mgmt}/models/tiny/profile", params={"batches": 1})
    assert reply.status_code == 401
    with pytest.raises(grpc.RpcError) as refused:
        grpc_management.ProfileModel(
            torchserve_stubs().mgmt.ProfileModelRequest(model_name="tiny"), timeout=10
        )
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("params", "named"),
    [({"batches": 0}, "batches"), ({"seconds": -1}, "seconds"), ({"seconds": 601}, "seconds")],
)
def test_bad_options_are_refused(
    server: ServerProcess, params: dict[str, float], named: str
) -> None:
    reply = httpx.post(
        f"{server.mgmt}/models/tiny/profile", params=params, headers=server.mgmt_headers
    )
    assert reply.status_code == 400 and named in reply.json()["message"]


def test_unknown_models(server: ServerProcess, grpc_management: Any) -> None:
    reply = httpx.post(
        f"{server.mgmt}/models/nope/profile", params={"batches": 1}, headers=server.mgmt_headers
    )
    assert reply.status_code == 404
    with pytest.raises(grpc.RpcError) as missing:
        grpc_management.ProfileModel(
            torchserve_stubs().mgmt.ProfileModelRequest(model_name="tiny", model_version="9.9"),
            metadata=key(server),
            timeout=10,
        )
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND
