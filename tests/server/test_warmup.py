"""Warm-up before ready, against real servers: the first request after ready no longer pays
for the lazy initialisation of a TorchScript model whose first calls are slow, which a server
without warm-up shows; describe reports each worker's warm-up; the per-model count and the
failures."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from serving import ServerProcess
from testmodels import save_torchscript
from torch import nn

from scriptserve.archiver.cli import model_archiver_main

# Slow: six servers started one after another for one measurement.
pytestmark = pytest.mark.slow

SERVERS = 3
"""Fresh servers per measurement: each gives one first request, a single sample at the mercy of
a busy machine's scheduler; the median of three is not."""
STEADY_REQUESTS = 30
SAMPLE = [0.5] * 8

# A handler that refuses requests without a header its clients send: the sample's warm-up
# requests carry none, so its warm-up fails.
TENANT_HANDLER = """
from scriptserve.handlers.base import HandlerError
from scriptserve.handlers.tensor import TensorHandler


class TenantHandler(TensorHandler):
    def handle(self, requests, context):
        if any("x-tenant" not in r.headers for r in requests):
            raise HandlerError("the X-Tenant header is missing", 400)
        return super().handle(requests, context)
"""


class ScriptedChain(nn.Module):
    """A TorchScript model whose first call is slow for reasons of TorchScript's own: a fresh
    process's first call sets up the interpreter and the kernels it runs (lazily), while the
    profiling executor runs it instrumented to record shapes; the second call optimises the
    graph (unrolling this loop of 200 steps). Measured on one core: about 55 ms, 15 ms, then
    10 ms per call. The steady call is long enough (8192 values per step) that a busy machine's
    scheduling noise stays small beside it."""

    def __init__(self, steps: int = 200, width: int = 8192) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.steps = steps
        self.fc = nn.Linear(8, 8)
        self.register_buffer("spread", torch.randn(8, width) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) @ self.spread
        for _ in range(self.steps):
            y = torch.tanh(y) * 0.5 + torch.sigmoid(y) - y * y * 0.01
        return y[:, :8]


def _archive(store: Path, work: Path, name: str, model: Path, **options: Any) -> None:
    sample = work / f"{name}.json"
    sample.write_text(json.dumps(SAMPLE))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--handler", options.pop("handler", "tensor"), "--export-path", str(store),
    ]  # fmt: skip
    if options.pop("with_sample", True):
        argv += ["--sample-input", str(sample)]
    if options:
        config = work / f"{name}.yaml"
        config.write_text(yaml.safe_dump(options))
        argv += ["--config-file", str(config)]
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("warmup")
    store, work = root / "store", root / "work"
    work.mkdir()
    chain = save_torchscript(work / "chain.pt", ScriptedChain())
    _archive(store, work, "chain", chain)
    # A process worker warms up in its own process; a count per model.
    _archive(store, work, "chain_process", chain, workerMode="process", warmupRuns=3)
    # A sample the handler refuses: the warm-up fails, the model serves all the same.
    (work / "tenant_handler.py").write_text(TENANT_HANDLER)
    _archive(store, work, "bad_sample", chain, handler=str(work / "tenant_handler.py"))
    _archive(store, work, "no_sample", chain, with_sample=False)
    return store


def describe(server: ServerProcess, model: str) -> dict[str, Any]:
    answer = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers, timeout=10)
    assert answer.status_code == 200, answer.text
    described: dict[str, Any] = answer.json()[0]
    return described


def first_and_steady(store: Path, *flags: str) -> tuple[float, float]:
    """Seconds of `chain`'s first request after ready on a fresh server, and the median of the
    requests after it (the steady-state p50)."""
    body = json.dumps(SAMPLE).encode()
    times = []
    server = ServerProcess(store, "--workers", "1", "--models", "chain.mar", *flags).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            # The HTTP path's own first-use costs (connection, routing, error answer), without
            # the model: an unknown model's request is answered before any model code runs.
            assert client.post("/predictions/not-a-model", content=body).status_code == 404
            for _ in range(1 + STEADY_REQUESTS):
                started = time.perf_counter()
                answer = client.post("/predictions/chain", content=body)
                times.append(time.perf_counter() - started)
                assert answer.status_code == 200, answer.text
        assert ("warmupMs" in describe(server, "chain")["workers"][0]) == (not flags)
    finally:
        server.stop()
    return times[0], statistics.median(times[1:])


@pytest.fixture(scope="module")
def warm(store: Path) -> Iterator[ServerProcess]:
    """Warm-up on (the default): every model, one worker each."""
    proc = ServerProcess(store, "--workers", "1").start()
    yield proc
    proc.stop()


def test_the_first_request_after_ready_no_longer_pays_for_lazy_initialisation(store: Path) -> None:
    cold, warm = [], []
    for _ in range(SERVERS):  # alternately, so that both see the machine alike
        cold.append(first_and_steady(store, "--no-warmup"))
        warm.append(first_and_steady(store))
    cold_first, cold_p50 = (statistics.median(m) for m in zip(*cold, strict=True))
    warm_first, warm_p50 = (statistics.median(m) for m in zip(*warm, strict=True))
    report = (
        f"first / steady p50: without warm-up {cold_first * 1000:.1f} / {cold_p50 * 1000:.1f} ms, "
        f"with warm-up {warm_first * 1000:.1f} / {warm_p50 * 1000:.1f} ms"
    )
    # Without warm-up the first request pays for the model's lazy initialisation (here about
    # 45 ms over the steady 6-8 ms)...
    cold_extra, warm_extra = cold_first - cold_p50, warm_first - warm_p50
    assert cold_extra > cold_p50, report
    # ...with it, the workers have paid before the model reported ready: what is left of the
    # extra is the first use of the request path around the model (1-3 ms here, up to 7 ms on a
    # machine busy with other builds), a fraction of it.
    assert warm_extra < cold_extra / 4, report


def test_describe_shows_each_workers_warmup(warm: ServerProcess) -> None:
    chain = describe(warm, "chain")
    assert chain["warmupRuns"] == 2  # the server's default
    (worker,) = chain["workers"]
    assert worker["warmupRuns"] == 2
    assert worker["warmupMs"] >= worker["warmupFirstRunMs"] > 0
    # The model's config sets its count; its process worker warmed up in its own process.
    process = describe(warm, "chain_process")
    assert process["warmupRuns"] == 3
    (worker,) = process["workers"]
    assert worker["mode"] == "process" and worker["pid"]
    assert worker["warmupRuns"] == 3
    assert worker["warmupMs"] > 0


def test_a_failed_or_impossible_warmup_leaves_the_model_serving(warm: ServerProcess) -> None:
    (bad,) = describe(warm, "bad_sample")["workers"]
    assert bad["warmupRuns"] == 0
    assert bad["warmupError"] == "run 1 failed: the X-Tenant header is missing"
    (unsampled,) = describe(warm, "no_sample")["workers"]
    assert unsampled["warmupSkipped"] == "the archive has no sample input"
    for model in ("bad_sample", "no_sample"):
        answer = httpx.post(
            f"{warm.url}/predictions/{model}", json=SAMPLE, headers={"X-Tenant": "a"}, timeout=30
        )
        assert answer.status_code == 200, answer.text
    assert httpx.get(f"{warm.url}/v2/health/ready", timeout=10).status_code == 200
