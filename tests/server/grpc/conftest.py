"""Fixtures for the gRPC tests: a slow server (one worker, a 0.3 s handler, a 64 KiB message
limit) shared by the back-pressure and load tests, and a TorchServe client generated from the
project's protos the way a TorchServe user makes one.

The OIP proto is never compiled in the test process: tritonclient registers package `inference`
in the default descriptor pool, and the same message names twice would collide.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import tsprotos
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import save_torchscript

from scriptserve.archiver.cli import model_archiver_main

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = ROOT / "server" / "grpc" / "proto"
SLEEP_S = 0.3
MAX_MESSAGE_BYTES = 65536
MAX_BATCH = 32

SLOW_HANDLER = f"""
import time

from scriptserve.handlers.tensor import TensorHandler


class SlowHandler(TensorHandler):
    def inference(self, batch):
        time.sleep({SLEEP_S})  # the workload: each batch keeps the one worker this busy
        return super().inference(batch)
"""


@pytest.fixture(scope="session")
def torchserve_stubs() -> SimpleNamespace:
    """TorchServe's client modules compiled from server/grpc/proto/ (tests/tsprotos.py)."""
    return tsprotos.torchserve_stubs()


def build_archive(
    store: Path, work: Path, name: str, model: Path, handler: str, config: dict[str, Any]
) -> None:
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--handler", handler, "--sample-input", str(sample), "--export-path", str(store),
    ]  # fmt: skip
    if config:
        config_file = work / f"{name}.yaml"
        config_file.write_text(json.dumps(config))  # JSON is YAML
        argv += ["--config-file", str(config_file)]
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="session")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One worker per model, batches of up to 32, gRPC messages up to 64 KiB. `slow` queues up
    to 2000 requests; `slow_q1` (same handler) has room for one waiting request."""
    root = tmp_path_factory.mktemp("slow")
    work, store = root / "work", root / "store"
    work.mkdir()
    model = save_torchscript(work / "tiny.pt")
    handler = work / "slow_handler.py"
    handler.write_text(textwrap.dedent(SLOW_HANDLER))
    build_archive(store, work, "slow", model, str(handler), {})
    build_archive(store, work, "slow_q1", model, str(handler), {"jobQueueSize": 1})
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--queue-size",
        "2000",
        "--max-batch-size",
        str(MAX_BATCH),
        env={"SCRIPTSERVE_GRPC_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES)},
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


def pending_requests(server: ServerProcess, model: str) -> int:
    """`jobQueueStatus.pendingRequests` of the model's default version (REST describe)."""
    r = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers)
    assert r.status_code == 200, r.text
    return int(r.json()[0]["jobQueueStatus"]["pendingRequests"])
