"""Model and server lifecycle: loading, failed loads beside healthy models, scaling under load,
and SIGTERM draining every accepted request."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import SlowMLP, reference_output, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

# Slow: servers started, drained and stopped for a few tests.
pytestmark = pytest.mark.slow

BROKEN_HANDLER = """\
raise RuntimeError("broken on purpose")
"""

GATED_HANDLER = """\
# Test handler: initialize waits until the file named by GATE_FILE exists, so that a test can
# look at the server while this model is still loading.
import os
import time
from pathlib import Path

from scriptserve.handlers.tensor import TensorHandler


class GatedHandler(TensorHandler):
    def initialize(self, context):
        gate = Path(os.environ["GATE_FILE"])
        Path(f"{gate}.waiting").touch()
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        super().initialize(context)
"""


def archive(root: Path, name: str, model: Path, handler: str = "tensor") -> None:
    sample = root / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--handler", handler, "--sample-input", str(sample), "--export-path", str(root / "store"),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0


class Lifecycle:
    """The module's server: `tiny` and `gated` load, `bad` and `broken` fail to."""

    def __init__(self, root: Path) -> None:
        self.gate = root / "gate"
        tiny = save_torchscript(root / "tiny.pt")
        archive(root, "tiny", tiny)
        broken = root / "broken_handler.py"
        broken.write_text(BROKEN_HANDLER)
        archive(root, "broken", tiny, str(broken))
        gated = root / "gated_handler.py"
        gated.write_text(GATED_HANDLER)
        archive(root, "gated", tiny, str(gated))
        (root / "store" / "bad.mar").write_bytes(np.random.default_rng(0).bytes(4096))
        self.server = ServerProcess(
            root / "store", "--workers", "1", env={"GATE_FILE": str(self.gate)}
        )

    def settled(self) -> ServerProcess:
        """Open the gate and wait until every model has loaded or failed."""
        self.gate.touch()

        def done(client: httpx.Client) -> bool:
            for name in ("bad", "broken", "gated", "tiny"):
                r = client.get(
                    f"{self.server.mgmt}/models/{name}", headers=self.server.mgmt_headers
                )
                if r.status_code != 200 or r.json()[0]["state"] not in ("READY", "FAILED"):
                    return False
            return True

        self.server.wait(done, 60)
        return self.server


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lifecycle]:
    state = Lifecycle(tmp_path_factory.mktemp("lifecycle"))
    state.server.start(wait_ready=False)  # returns once liveness answers
    yield state
    state.gate.touch()
    state.server.stop()


def predict(server: ServerProcess, model: str, x: np.ndarray) -> httpx.Response:
    return httpx.post(f"{server.url}/predictions/{model}", json=x.tolist(), timeout=30)


def test_live_but_not_ready_while_a_model_is_loading(lifecycle: Lifecycle) -> None:
    if lifecycle.gate.exists():
        pytest.skip("the gated model was already released by an earlier test")
    server = lifecycle.server
    # The gated handler is inside initialize() once it touched its marker.
    server.wait(lambda _: Path(f"{lifecycle.gate}.waiting").exists(), 60)
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 503
    assert httpx.get(f"{server.url}/ping").status_code == 503
    lifecycle.settled()
    r = predict(server, "gated", np.ones(8, dtype=np.float32))
    assert r.status_code == 200, r.text


def test_failed_models_leave_the_others_serving(lifecycle: Lifecycle) -> None:
    server = lifecycle.settled()
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    r = predict(server, "tiny", x)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference_output(x[None])[0], atol=1e-5)

    ping = httpx.get(f"{server.url}/ping")
    assert (ping.status_code, ping.json()["status"]) == (503, "Unhealthy")
    ready = httpx.get(f"{server.url}/v2/health/ready")
    assert (ready.status_code, ready.json()["ready"]) == (503, False)
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 200

    for name, why in (("bad", "not a model archive"), ("broken", "broken on purpose")):
        (described,) = httpx.get(f"{server.mgmt}/models/{name}", headers=server.mgmt_headers).json()
        assert described["state"] == "FAILED"
        assert why in described["reason"]
        r = predict(server, name, x)
        assert r.status_code == 503, r.text
        assert described["reason"] in r.json()["message"]
        v2 = httpx.post(
            f"{server.url}/v2/models/{name}/infer",
            json={
                "inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": x.tolist()}]
            },
        )
        assert v2.status_code == 503, v2.text
        assert why in v2.json()["error"]


def test_scaling_workers_under_load_loses_no_request(lifecycle: Lifecycle) -> None:
    server = lifecycle.settled()
    total, concurrency = 300, 16
    x = np.random.default_rng(3).standard_normal((total, 8)).astype(np.float32)
    expected = reference_output(x)
    done = 0
    workers_seen: list[int] = []

    async def client_task(client: httpx.AsyncClient, gate: asyncio.Semaphore, i: int) -> None:
        nonlocal done
        async with gate:
            r = await client.post(f"{server.url}/predictions/tiny", json=x[i].tolist())
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json(), expected[i], atol=1e-5, err_msg=f"request {i}")
        done += 1

    async def scaler(client: httpx.AsyncClient) -> None:
        for workers, after in ((1, 20), (3, 80), (1, 180)):
            while done < after:
                await asyncio.sleep(0.001)
            r = await client.put(
                f"{server.mgmt}/models/tiny",
                headers=server.mgmt_headers,
                params={"min_worker": workers, "synchronous": "true"},
            )
            assert r.status_code == 200, r.text
            (described,) = (
                await client.get(f"{server.mgmt}/models/tiny", headers=server.mgmt_headers)
            ).json()
            workers_seen.append(len(described["workers"]))

    async def run() -> None:
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(
                scaler(client), *(client_task(client, gate, i) for i in range(total))
            )

    asyncio.run(run())
    assert done == total
    assert workers_seen == [1, 3, 1]


def test_sigterm_drains_every_accepted_request(tmp_path: Path) -> None:
    archive(tmp_path, "slow", save_torchscript(tmp_path / "slow.pt", SlowMLP()))
    server = ServerProcess(
        tmp_path / "store", "--workers", "1", "--max-batch-size", "4", "--max-batch-delay", "0"
    ).start()
    total = 50
    x = np.random.default_rng(5).standard_normal((total, 8)).astype(np.float32)
    expected = reference_output(x)

    def accepted(text: str) -> float:
        """Requests the batcher holds or handed to the worker, from one /metrics scrape."""
        count = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("model") != "slow":
                    continue
                if s.name in ("scriptserve_queue_depth", "scriptserve_batch_size_sum"):
                    count += s.value
        return count

    async def run() -> tuple[list[httpx.Response | BaseException], list[int]]:
        limits = httpx.Limits(max_connections=total + 8)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            calls = [
                asyncio.ensure_future(
                    client.post(f"{server.url}/predictions/slow", json=row.tolist())
                )
                for row in x
            ]
            # Wait (polling, with a deadline) until the server holds all of them, twice in a row.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            stable = 0
            while stable < 2:
                assert loop.time() < deadline, "the server never accepted every request"
                scrape = await client.get(f"{server.metrics_url}/metrics")
                stable = stable + 1 if accepted(scrape.text) >= total else 0
                await asyncio.sleep(0.01)
            assert not all(c.done() for c in calls), "the model is too fast to test draining"
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            # Readiness stops answering 200 (503, or the listener is gone) during the drain.
            ready_codes: list[int] = []
            while loop.time() < deadline:
                try:
                    r = await client.get(f"{server.url}/v2/health/ready", timeout=2)
                except httpx.TransportError:
                    ready_codes.append(0)
                    break
                ready_codes.append(r.status_code)
                if r.status_code != 200:
                    break
                await asyncio.sleep(0.01)
            results = await asyncio.gather(*calls, return_exceptions=True)
            return results, ready_codes

    try:
        results, ready_codes = asyncio.run(run())
        code = server.terminate(60)
    finally:
        server.stop()
    refused = [r for r in results if isinstance(r, httpx.ConnectError)]
    other = [r for r in results if isinstance(r, BaseException) and r not in refused]
    assert not other, f"requests failed after they were accepted: {other!r}"
    assert not refused, f"{len(refused)} requests were refused before they were accepted"
    for i, r in enumerate(results):
        assert isinstance(r, httpx.Response)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json(), expected[i], atol=1e-5, err_msg=f"request {i}")
    assert ready_codes[-1] in (0, 503), ready_codes
    assert code == 0, server.output()
    assert "stopped" in server.output()
