"""Deadlines, cancels and back-pressure against a real server: a client deadline only shortens
the server's, an expired request never runs, a late handler still gets the client 504 on time,
cancels leave no queued or pending work behind, and a full queue answers 503 at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from serving import ServerProcess
from tritonclient.grpc import service_pb2, service_pb2_grpc

# Slow: workers failing and servers draining under load.
pytestmark = pytest.mark.slow

SLEEP_S = 1.5
RESPONSE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def server(slow_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    run_log = tmp_path_factory.mktemp("runlog") / "runs.log"
    run_log.touch()
    proc = ServerProcess(
        slow_store,
        "--workers",
        "1",
        "--response-timeout",
        str(RESPONSE_TIMEOUT_S),
        "--queue-size",
        "4",
        env={"RUN_LOG": str(run_log), "SLEEP_S": str(SLEEP_S)},
    ).start()
    proc.run_log = run_log  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def body(marker: float) -> list[float]:
    return [marker] + [0.0] * 7


def queue_status(server: ServerProcess, model: str = "slow") -> dict[str, int]:
    r = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers)
    return r.json()[0]["jobQueueStatus"]  # type: ignore[no-any-return]


def settle(server: ServerProcess) -> None:
    """Wait until nothing is queued or in flight."""
    server.wait(
        lambda c: (
            (s := queue_status(server))["pendingRequests"] == 0 and s["inFlightRequests"] == 0
        ),
        60,
    )


def runs(server: ServerProcess) -> list[str]:
    return server.run_log.read_text().split()  # type: ignore[attr-defined, no-any-return]


async def _expired_in_queue(server: ServerProcess) -> tuple[httpx.Response, float, httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        url = f"{server.url}/predictions/slow"
        first = asyncio.create_task(client.post(url, json=body(101)))
        await asyncio.sleep(0.3)  # let the first one reach the worker
        started = time.monotonic()
        second = await client.post(url, json=body(202), headers={"X-Request-Timeout": "0.5"})
        elapsed = time.monotonic() - started
        return second, elapsed, await first


def test_expired_in_queue_is_dropped_before_running(server: ServerProcess) -> None:
    settle(server)
    second, elapsed, first = asyncio.run(_expired_in_queue(server))
    assert second.status_code == 504, second.text
    assert "0.5 s" in second.json()["message"]
    assert elapsed < SLEEP_S  # answered on its own deadline, not after the first one ran
    assert first.status_code == 200
    settle(server)
    assert "101" in runs(server)
    assert "202" not in runs(server)


def test_late_handler_gets_504_on_time_and_client_cannot_lengthen(server: ServerProcess) -> None:
    settle(server)
    url = f"{server.url}/predictions/slow"
    started = time.monotonic()
    r = httpx.post(url, json=body(303), headers={"X-Request-Timeout": "0.4"}, timeout=30)
    assert r.status_code == 504
    assert time.monotonic() - started < SLEEP_S
    # Asking for 60 s does not lengthen the server's 3 s: SLEEP_S x 3 queued work exceeds it.
    with httpx.Client(timeout=30) as client:
        settle(server)
        started = time.monotonic()
        responses = []
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(
                    client.post, url, json=body(400 + i), headers={"X-Request-Timeout": "60"}
                )
                for i in range(3)
            ]
            responses = [f.result() for f in futures]
    codes = sorted(r.status_code for r in responses)
    assert codes[-1] == 504, codes
    assert time.monotonic() - started < RESPONSE_TIMEOUT_S + SLEEP_S + 2
    for bad in ("0", "-1", "nan", "soon"):
        r = httpx.post(url, json=body(1), headers={"X-Request-Timeout": bad})
        assert r.status_code == 400
        assert "X-Request-Timeout" in r.json()["message"]


def test_grpc_deadline(server: ServerProcess) -> None:
    settle(server)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="tiny")
        tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 8])
        tensor.contents.fp32_contents.extend([0.5] * 8)
        assert stub.ModelInfer(request, timeout=30).model_name == "tiny"


async def _cancel_many(server: ServerProcess, count: int) -> None:
    url = f"{server.url}/predictions/slow"
    async with httpx.AsyncClient(timeout=httpx.Timeout(0.05, connect=10)) as client:

        async def one(i: int) -> None:
            # The client gives up (times out): the deliberate cancel.
            with contextlib.suppress(httpx.TimeoutException):
                await client.post(url, json=body(1000 + i))

        await asyncio.gather(*(one(i) for i in range(count)))


def test_cancels_free_their_slots(server: ServerProcess) -> None:
    settle(server)
    before = httpx.get(f"{server.mgmt}/models/slow", headers=server.mgmt_headers).json()[0]
    for _ in range(5):
        asyncio.run(_cancel_many(server, 40))
    settle(server)  # every queued and in-flight request is accounted for again
    after = httpx.get(f"{server.mgmt}/models/slow", headers=server.mgmt_headers).json()[0]
    # The same worker: none killed or replaced, the model not reloaded.
    assert [(w["id"], w["startTime"]) for w in after["workers"]] == [
        (w["id"], w["startTime"]) for w in before["workers"]
    ]
    assert after["state"] == "READY"
    r = httpx.post(f"{server.url}/predictions/slow", json=body(7), timeout=30)
    assert r.status_code == 200


async def _flood(server: ServerProcess) -> list[tuple[int, str | None, float]]:
    url = f"{server.url}/predictions/slow"
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int) -> tuple[int, str | None, float]:
            started = time.monotonic()
            r = await client.post(url, json=body(2000 + i))
            return r.status_code, r.headers.get("retry-after"), time.monotonic() - started

        return await asyncio.gather(*(one(i) for i in range(12)))


def test_full_queue_answers_503_at_once(server: ServerProcess) -> None:
    settle(server)
    results = asyncio.run(_flood(server))
    refused = [r for r in results if r[0] == 503]
    assert refused, results
    for _, retry_after, elapsed in refused:
        assert retry_after is not None
        assert elapsed < SLEEP_S
    assert all(code in (200, 503, 504) for code, _, _ in results)
    settle(server)
