"""A version left with no worker answers what it had queued at once: scaling it to 0 workers or
unregistering it fails its queued requests with 503 saying why (not at their deadline), the
requests already running finish, new requests are refused at once, DELETE returns without
waiting out the drain timeout, and the other models serve throughout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import ServerProcess

# Slow: workers failing and servers draining under load.
pytestmark = pytest.mark.slow

SLEEP_S = 2.0
"""How long the slow handler runs each request."""
AT_ONCE_S = 1.5
"""How soon after the scale or unregister a queued request must be answered: at once, give or
take a loaded machine's scheduling (its deadline is the response timeout, 120 s)."""
DRAIN_S = 30.0
QUEUED = 4


@pytest.fixture(scope="module")
def server(slow_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    run_log = tmp_path_factory.mktemp("runs") / "runs.log"
    proc = ServerProcess(
        slow_store,
        "--workers",
        "1",
        "--enable-model-api",
        "--no-snapshot",
        "--drain-timeout",
        str(DRAIN_S),
        env={"RUN_LOG": str(run_log), "SLEEP_S": str(SLEEP_S)},
    ).start()
    yield proc
    proc.stop()


def body(i: int) -> list[float]:
    return [float(i)] + [0.0] * 7


async def timed_post(client: httpx.AsyncClient, url: str, i: int) -> tuple[httpx.Response, float]:
    response = await client.post(url, json=body(i))
    return response, time.monotonic()


async def one_running_and_queued(
    client: httpx.AsyncClient, server: ServerProcess, model: str
) -> list[asyncio.Task[tuple[httpx.Response, float]]]:
    """One request running on the model's only worker and QUEUED more waiting behind it."""
    url = f"{server.url}/predictions/{model}"
    running = asyncio.create_task(timed_post(client, url, 100))
    deadline = time.monotonic() + 30
    while True:
        (described,) = (
            await client.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers)
        ).json()
        if [w["status"] for w in described["workers"]] == ["BUSY"]:
            break
        assert time.monotonic() < deadline, described
        await asyncio.sleep(0.02)
    queued = [asyncio.create_task(timed_post(client, url, i)) for i in range(QUEUED)]
    while True:
        (described,) = (
            await client.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers)
        ).json()
        if described["jobQueueStatus"]["pendingRequests"] == QUEUED:
            break
        assert time.monotonic() < deadline, described
        await asyncio.sleep(0.02)
    return [running, *queued]


def assert_answered_at_once(
    answers: list[tuple[httpx.Response, float]], since: float, why: str
) -> None:
    for response, at in answers:
        assert response.status_code == 503, response.text
        assert why in response.json()["message"], response.text
        assert at - since < AT_ONCE_S, f"answered {at - since:.2f} s after the change"


def tiny_serves(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/tiny", json=[0.5] * 8, timeout=30)
    assert r.status_code == 200, r.text


def test_scaling_to_zero_fails_the_queue_at_once_and_refuses_new_requests(
    server: ServerProcess,
) -> None:
    mgmt, headers = server.mgmt, server.mgmt_headers

    async def scenario() -> tuple[list[tuple[httpx.Response, float]], float]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = await one_running_and_queued(client, server, "slow")
            scaled = time.monotonic()
            r = await client.put(
                f"{mgmt}/models/slow", params={"min_worker": 0}, headers=headers
            )  # TorchServe's default: asynchronous (202)
            assert r.status_code == 202, r.text
            return list(await asyncio.gather(*tasks)), scaled

    answers, scaled = asyncio.run(scenario())
    (running, _), *queued = answers
    # The request the worker had taken finishes; the queued ones are answered 503 at once.
    assert running.status_code == 200, running.text
    assert_answered_at_once(
        queued, scaled, "model 'slow' version 1.0 was scaled to 0 workers; scale it up again"
    )

    started = time.monotonic()
    r = httpx.post(f"{server.url}/predictions/slow", json=body(9), timeout=30)
    assert r.status_code == 503 and time.monotonic() - started < AT_ONCE_S, r.text
    assert httpx.get(f"{server.url}/v2/models/slow/ready").status_code == 503
    # The operator asked for no capacity: the replica stays ready for its other models.
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    tiny_serves(server)
    (described,) = httpx.get(f"{mgmt}/models/slow", headers=headers).json()
    assert (described["workers"], described["jobQueueStatus"]["pendingRequests"]) == ([], 0)

    r = httpx.put(
        f"{mgmt}/models/slow",
        params={"min_worker": 1, "synchronous": "true"},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/predictions/slow", json=body(10), timeout=30)
    assert r.status_code == 200, r.text


def test_unregistering_fails_the_queue_at_once_and_returns_after_the_running_request(
    server: ServerProcess,
) -> None:
    mgmt, headers = server.mgmt, server.mgmt_headers
    params = {"url": "slow.mar", "model_name": "slow_copy", "initial_workers": 1}
    r = httpx.post(f"{mgmt}/models", params=params, headers=headers, timeout=120)
    assert r.status_code == 200, r.text

    async def scenario() -> tuple[list[tuple[httpx.Response, float]], float, float]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = await one_running_and_queued(client, server, "slow_copy")
            sent = time.monotonic()
            r = await client.delete(f"{mgmt}/models/slow_copy", headers=headers)
            assert r.status_code == 200, r.text
            took = time.monotonic() - sent
            return list(await asyncio.gather(*tasks)), sent, took

    answers, sent, took = asyncio.run(scenario())
    (running, _), *queued = answers
    assert running.status_code == 200, running.text  # it was running: it finished
    assert_answered_at_once(queued, sent, "model 'slow_copy' version 1.0 was unregistered")
    # DELETE waited for the running request only (at most SLEEP_S), not for the drain timeout.
    assert took < SLEEP_S + AT_ONCE_S, took
    r = httpx.post(f"{server.url}/predictions/slow_copy", json=body(9), timeout=30)
    assert r.status_code == 404, r.text
    tiny_serves(server)


def test_unregistering_a_version_with_no_worker_returns_at_once(server: ServerProcess) -> None:
    mgmt, headers = server.mgmt, server.mgmt_headers
    params = {"url": "slow.mar", "model_name": "idle_copy", "initial_workers": 1}
    r = httpx.post(f"{mgmt}/models", params=params, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.put(
        f"{mgmt}/models/idle_copy",
        params={"min_worker": 0, "synchronous": "true"},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    started = time.monotonic()
    r = httpx.delete(f"{mgmt}/models/idle_copy", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert time.monotonic() - started < AT_ONCE_S
    tiny_serves(server)
    assert "Traceback" not in server.output()
