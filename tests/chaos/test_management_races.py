"""Management under load: while REST and gRPC clients send a steady stream of requests, one
thread registers, scales (up, down, to 0 and back), sets defaults and unregisters versions of
`churn`. Every answer is 200 or a clean 404 / 503 with a message (never a 500, a reset or a
hang), `steady` answers every request 200 throughout, nothing is logged with a traceback, and
afterwards describe shows a consistent state and the model serves."""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from hardening import archive
from serving import ServerProcess
from tritonclient.utils import InferenceServerException

# Slow: workers failing and servers draining under load.
pytestmark = pytest.mark.slow

CHURN_S = 12.0
"""How long the management thread keeps changing `churn`."""
ANSWER_BOUND_S = 10.0
"""No request may take longer (they take milliseconds; the response timeout is 120 s)."""
CLEAN_REST = {200, 404, 503}
CLEAN_GRPC = {"StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE"}


@dataclass(frozen=True)
class Answer:
    client: str
    target: str
    outcome: str
    """HTTP status or gRPC code, or the exception that ended the call."""
    message: str
    seconds: float


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("races")
    store, work = root / "store", root / "work"
    archive(store, work, "steady")
    archive(store, work, "churn")
    v2 = archive(root / "v2", work, "churn", version="2.0")
    shutil.copy(v2, store / "churn_v2.mar")
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--enable-model-api",
        "--no-snapshot",
        "--models",
        "steady.mar",
        "churn.mar",
    ).start(timeout_s=120)
    yield proc
    proc.stop()


def v2_body(seed: int) -> dict[str, Any]:
    x = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    return {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": x.tolist()}]}


def rest_client(server: ServerProcess, stop: threading.Event, answers: list[Answer]) -> None:
    targets = [
        ("churn", "/v2/models/churn/infer"),
        ("churn", "/v2/models/churn/versions/2.0/infer"),
        ("churn", "/predictions/churn"),
        ("steady", "/v2/models/steady/infer"),
    ]
    with httpx.Client(base_url=server.url, timeout=ANSWER_BOUND_S) as client:
        i = 0
        while not stop.is_set():
            model, path = targets[i % len(targets)]
            body: Any = [0.5] * 8 if path.startswith("/predictions") else v2_body(i)
            started = time.monotonic()
            try:
                r = client.post(path, json=body)
            except httpx.HTTPError as exc:
                outcome, message = type(exc).__name__, str(exc)
            else:
                outcome = str(r.status_code)
                message = "" if r.status_code == 200 else r.text
            answers.append(Answer("rest", model, outcome, message, time.monotonic() - started))
            i += 1


def grpc_client(server: ServerProcess, stop: threading.Event, answers: list[Answer]) -> None:
    client = triton.InferenceServerClient(server.grpc)
    x = np.full((1, 8), 0.5, dtype=np.float32)
    tensor = triton.InferInput("x", [1, 8], "FP32")
    tensor.set_data_from_numpy(x)
    try:
        i = 0
        while not stop.is_set():
            model = ("churn", "steady")[i % 2]
            started = time.monotonic()
            try:
                client.infer(model, [tensor], client_timeout=ANSWER_BOUND_S)
            except InferenceServerException as exc:
                outcome, message = str(exc.status()), str(exc.message())
            else:
                outcome, message = "OK", ""
            answers.append(Answer("grpc", model, outcome, message, time.monotonic() - started))
            i += 1
    finally:
        client.close()


class Operator:
    """The management calls, each of which must succeed."""

    def __init__(self, server: ServerProcess) -> None:
        self.client = httpx.Client(base_url=server.mgmt, headers=server.mgmt_headers, timeout=60)
        self.calls: Counter[str] = Counter()

    def call(self, method: str, path: str, expect: tuple[int, ...], **params: Any) -> None:
        r = self.client.request(method, path, params=params)
        assert r.status_code in expect, (method, path, params, r.status_code, r.text)
        self.calls[method] += 1

    def register(self, url: str) -> None:
        self.call("POST", "/models", (200,), url=url, synchronous="true")

    def scale(self, version: str, workers: int, synchronous: bool = True) -> None:
        expect = (200,) if synchronous else (202,)
        self.call(
            "PUT",
            f"/models/churn/{version}",
            expect,
            min_worker=workers,
            synchronous=str(synchronous).lower(),
        )

    def set_default(self, version: str) -> None:
        self.call("PUT", f"/models/churn/{version}/set-default", (200,))

    def unregister(self, version: str | None) -> None:
        self.call("DELETE", "/models/churn" + (f"/{version}" if version else ""), (200,))

    def cycle(self, n: int) -> None:
        """From v1.0 alone (default, 1 worker) through two versions, back to v1.0 alone."""
        self.register("churn_v2.mar")
        self.scale("2.0", 2)
        self.set_default("2.0")
        self.scale("1.0", 0, synchronous=False)
        self.scale("1.0", 1)
        self.set_default("1.0")
        self.scale("2.0", 0)
        self.unregister("2.0")
        if n % 2:  # the whole model goes away for a moment
            self.unregister(None)
            self.register("churn.mar")


def run_churn(server: ServerProcess) -> tuple[list[Answer], Operator, int]:
    stop = threading.Event()
    answers: list[Answer] = []
    clients: list[Callable[..., None]] = [rest_client, rest_client, grpc_client]
    threads = [
        threading.Thread(target=c, args=(server, stop, answers), daemon=True) for c in clients
    ]
    for thread in threads:
        thread.start()
    operator = Operator(server)
    cycles = 0
    try:
        deadline = time.monotonic() + CHURN_S
        while time.monotonic() < deadline:
            operator.cycle(cycles)
            cycles += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(ANSWER_BOUND_S + 5)
        operator.client.close()
    assert not any(t.is_alive() for t in threads), "a client is stuck"
    return answers, operator, cycles


def test_management_under_load_answers_every_request_cleanly(server: ServerProcess) -> None:
    answers, operator, cycles = run_churn(server)

    assert cycles >= 2 and operator.calls["DELETE"] >= cycles, (cycles, operator.calls)
    outcomes = Counter((a.client, a.target, a.outcome) for a in answers)
    steady = [a for a in answers if a.target == "steady"]
    assert steady and all(a.outcome in ("200", "OK") for a in steady), outcomes
    churn = [a for a in answers if a.target == "churn"]
    unclean = [
        a for a in churn
        if a.outcome not in {"OK", *map(str, CLEAN_REST), *CLEAN_GRPC}
        or (a.outcome not in ("200", "OK") and not a.message)
    ]  # fmt: skip
    assert not unclean, (unclean[:5], outcomes)
    # Each client saw churn both serve and refuse while it changed.
    assert any(a.outcome in ("200", "OK") for a in churn), outcomes
    assert any(a.outcome not in ("200", "OK") for a in churn), outcomes
    slowest = max(a.seconds for a in answers)
    assert slowest < ANSWER_BOUND_S, slowest

    log = server.output()
    assert "Traceback" not in log, log[-5000:]

    # Afterwards: v1.0 alone, the default, with its one worker, nothing queued or in flight.
    headers = server.mgmt_headers
    described = httpx.get(f"{server.mgmt}/models/churn/all", headers=headers, timeout=10).json()
    assert [(d["modelVersion"], d["isDefault"], d["state"]) for d in described] == [
        ("1.0", True, "READY")
    ], described
    (v1,) = described
    assert v1["minWorkers"] == len(v1["workers"]) == 1, v1
    assert [w["status"] for w in v1["workers"]] == ["READY"], v1
    assert v1["jobQueueStatus"]["pendingRequests"] == 0
    assert v1["jobQueueStatus"]["inFlightRequests"] == 0
    r = httpx.post(f"{server.url}/v2/models/churn/infer", json=v2_body(1), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model_version"] == "1.0"
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
    listed = httpx.get(f"{server.mgmt}/models", headers=headers, timeout=10).json()
    assert sorted(m["modelName"] for m in listed["models"]) == ["churn", "steady"]
