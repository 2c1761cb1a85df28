"""Under concurrent load: every client gets its own answer, batches form and stay within bounds,
and a lone request is not held back by batching (measured by the server's own histograms)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import SlowMLP, reference_output, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

# Slow: concurrent load on servers started for a few tests.
pytestmark = pytest.mark.slow

CLIENTS = 64
MAX_BATCH = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One worker running a ~0.1 s model, so concurrent requests queue and batch."""
    root = tmp_path_factory.mktemp("load")
    sample = root / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    model = save_torchscript(root / "slow.pt", SlowMLP())
    argv = [
        "--model-name", "slow", "--version", "1.0", "--serialized-file", str(model),
        "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(root / "store"),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    proc = ServerProcess(
        root / "store",
        "--workers",
        "1",
        "--max-batch-size",
        str(MAX_BATCH),
        "--max-batch-delay",
        "0",
        "--enable-model-api",
    ).start()
    yield proc
    proc.stop()


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """One sample's value from the server's /metrics (0 when the series does not exist yet)."""
    text = httpx.get(f"{server.metrics_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def inputs() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((CLIENTS, 8)).astype(np.float32)


async def predictions(server: ServerProcess, model: str, x: np.ndarray) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        calls = [client.post(f"{server.url}/predictions/{model}", json=row.tolist()) for row in x]
        return await asyncio.gather(*calls)


async def v2_infer(server: ServerProcess, model: str, x: np.ndarray) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        calls = [
            client.post(
                f"{server.url}/v2/models/{model}/infer",
                json={
                    "id": f"req-{i}",
                    "inputs": [
                        {"name": "x", "shape": [1, 8], "datatype": "FP32", "data": row.tolist()}
                    ],
                },
            )
            for i, row in enumerate(x)
        ]
        return await asyncio.gather(*calls)


def test_concurrent_predictions_each_get_their_own_output(server: ServerProcess) -> None:
    x = inputs()
    expected = reference_output(x)
    responses = asyncio.run(predictions(server, "slow", x))
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json(), expected[i], atol=1e-5, err_msg=f"client {i}")


def test_concurrent_v2_infer_each_get_their_own_output(server: ServerProcess) -> None:
    x = inputs()[::-1].copy()
    expected = reference_output(x)
    responses = asyncio.run(v2_infer(server, "slow", x))
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == f"req-{i}"
        (output,) = body["outputs"]
        assert output["shape"] == [1, 3]
        np.testing.assert_allclose(output["data"], expected[i], atol=1e-5, err_msg=f"client {i}")


def test_busy_worker_batches_queued_requests_within_the_max_batch_size(
    server: ServerProcess,
) -> None:
    labels = {"model": "slow", "version": "1.0"}

    def batches() -> tuple[float, float, float]:
        return (
            metric(server, "scriptserve_batch_size_count", **labels),
            metric(server, "scriptserve_batch_size_sum", **labels),
            metric(server, "scriptserve_batch_size_bucket", le=f"{MAX_BATCH:.1f}", **labels),
        )

    count0, sum0, within0 = batches()
    responses = asyncio.run(predictions(server, "slow", inputs()))
    assert all(r.status_code == 200 for r in responses)
    count1, sum1, within1 = batches()
    runs, requests = count1 - count0, sum1 - sum0
    assert requests == CLIENTS
    assert runs < requests, "no batch larger than 1 formed although requests queued"
    assert runs >= CLIENTS / MAX_BATCH
    assert within1 - within0 == runs, f"a batch exceeded max_batch_size {MAX_BATCH}"


def lone_request_queue_latency(server: ServerProcess, model: str) -> tuple[float, float]:
    """(requests, of which queued <= 100 ms) for one lone request, as the server measured it.

    100 ms, not less: on two cores shared with the rest of the suite, handing a request to a
    free worker has taken up to tens of milliseconds. A batch delay holds it for the whole
    delay (TorchServe's default is 100 ms; the test below configures 200 ms)."""
    labels = {"model": model, "version": "1.0"}

    def read() -> tuple[float, float]:
        return (
            metric(server, "scriptserve_queue_latency_seconds_count", **labels),
            metric(server, "scriptserve_queue_latency_seconds_bucket", le="0.1", **labels),
        )

    before = read()
    x = inputs()[:1]
    r = httpx.post(f"{server.url}/predictions/{model}", json=x[0].tolist(), timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference_output(x)[0], atol=1e-5)
    after = read()
    return after[0] - before[0], after[1] - before[1]


def test_lone_request_is_not_delayed_without_a_batch_delay(server: ServerProcess) -> None:
    assert lone_request_queue_latency(server, "slow") == (1, 1)


def test_lone_request_waits_out_a_configured_batch_delay(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.mgmt}/models",
        headers=server.mgmt_headers,
        params={
            "url": "slow.mar",
            "model_name": "slow_delayed",
            "max_batch_delay": 200,
            "initial_workers": 1,
            "synchronous": "true",
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    (described,) = httpx.get(
        f"{server.mgmt}/models/slow_delayed", headers=server.mgmt_headers
    ).json()
    assert described["maxBatchDelay"] == 200
    # Queued for the whole delay (>= 0.2 s), as the server itself measured it.
    assert lone_request_queue_latency(server, "slow_delayed") == (1, 0)
