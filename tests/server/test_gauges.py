"""Process, worker and GPU gauges on /metrics against a real server: the server process under
Prometheus's standard names, each worker's busy state while a batch runs, a process worker's own
CPU time and memory, and CUDA memory where there is a GPU."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import save_torchscript

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.server.observability.gauges import GpuCollector, process_usage

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

SLOW_HANDLER = """
import time

from scriptserve.handlers.tensor import TensorHandler


class Slow(TensorHandler):
    def inference(self, batch):
        time.sleep(1.0)
        return super().inference(batch)
"""


def archive(work: Path, store: Path, name: str, handler: str, config: dict[str, str]) -> None:
    (work / "sample.json").write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file",
        str(save_torchscript(work / "tiny.pt")), "--handler", handler,
        "--sample-input", str(work / "sample.json"), "--export-path", str(store),
    ]  # fmt: skip
    if config:
        (work / f"{name}.yaml").write_text(json.dumps(config))
        argv += ["--config-file", str(work / f"{name}.yaml")]
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("gauges")
    store = work / "store"
    (work / "slow.py").write_text(SLOW_HANDLER)
    archive(work, store, "slow", str(work / "slow.py"), {})
    archive(work, store, "isolated", "tensor", {"workerMode": "process"})
    proc = ServerProcess(store, "--workers", "1").start()
    yield proc
    proc.stop()


def samples(server: ServerProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{server.metrics_url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found[(name, frozenset(labels.items()))]


def test_the_server_process_is_measured(server: ServerProcess) -> None:
    found = samples(server)
    assert value(found, "process_resident_memory_bytes") > 50e6
    assert value(found, "process_cpu_seconds_total") > 0
    assert value(found, "process_open_fds") > 5


def test_a_worker_is_busy_while_it_runs_a_batch(server: ServerProcess) -> None:
    worker = {"model": "slow", "version": "1.0", "worker": "1"}
    assert value(samples(server), "scriptserve_worker_busy", **worker) == 0
    answered: list[int] = []
    request = threading.Thread(
        target=lambda: answered.append(
            httpx.post(f"{server.url}/predictions/slow", json=[0.5] * 8, timeout=30).status_code
        )
    )
    request.start()
    deadline = time.monotonic() + 0.8
    busy = 0.0
    while busy == 0 and time.monotonic() < deadline:
        busy = value(samples(server), "scriptserve_worker_busy", **worker)
    request.join()
    assert busy == 1 and answered == [200]
    assert value(samples(server), "scriptserve_worker_busy", **worker) == 0


def test_a_process_worker_reports_its_own_cpu_and_memory(server: ServerProcess) -> None:
    worker = {"model": "isolated", "version": "1.0", "worker": "1"}
    found = samples(server)
    assert value(found, "scriptserve_worker_resident_memory_bytes", **worker) > 20e6
    assert value(found, "scriptserve_worker_cpu_seconds_total", **worker) > 0
    # Thread workers live in the server process: they have no figures of their own.
    assert (
        "scriptserve_worker_resident_memory_bytes",
        frozenset({"model": "slow", "version": "1.0", "worker": "1"}.items()),
    ) not in found


def test_process_usage_reads_proc_as_psutil_does() -> None:
    usage = process_usage(os.getpid())
    assert usage is not None
    me = psutil.Process()
    cpu = me.cpu_times()
    assert abs(usage[0] - (cpu.user + cpu.system)) < 0.5
    assert abs(usage[1] - me.memory_info().rss) < 0.1 * me.memory_info().rss
    assert process_usage(2**22 + 12345) is None  # no such process


@pytest.mark.gpu
def test_gpu_memory_is_reported_per_device() -> None:
    held = torch.ones(1024, 1024, device="cuda:0")  # 4 MiB of tensors
    families = {f.name: f for f in GpuCollector().collect()}
    allocated = {
        s.labels["device"]: s.value
        for s in families["scriptserve_gpu_memory_allocated_bytes"].samples
    }
    assert allocated["cuda:0"] >= held.numel() * 4
    reserved = families["scriptserve_gpu_memory_reserved_bytes"].samples
    assert reserved[0].value >= allocated["cuda:0"]
