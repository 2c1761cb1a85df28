"""A worker thread runs the model with the intra-op threads it was given: OpenMP keeps its
thread count per thread, so the loading thread's setting must be made again on each worker
thread (a TorchScript model on a new thread otherwise used every core)."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator

import httpx
import pytest
from serving import ServerProcess
from testmodels import save_torchscript

from scriptserve.archiver.cli import model_archiver_main

# Slow: a server started for one test.
pytestmark = pytest.mark.slow

# What OpenMP will use for this thread's next parallel region (libgomp, loaded by torch).
OMP_REPORTER = """
import ctypes

import torch

from scriptserve.handlers.base import InferenceResponse
from scriptserve.handlers.tensor import TensorHandler

_GOMP = ctypes.CDLL("libgomp.so.1")


class OmpReporter(TensorHandler):
    def handle(self, requests, context):
        super().handle(requests, context)
        threads = {"omp": _GOMP.omp_get_max_threads(), "torch": torch.get_num_threads()}
        return [InferenceResponse(body=threads) for _ in requests]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("omp")
    store = work / "store"
    (work / "omp_reporter.py").write_text(textwrap.dedent(OMP_REPORTER))
    (work / "sample.json").write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", "omp", "--version", "1.0",
        "--serialized-file", str(save_torchscript(work / "tiny.pt")),
        "--handler", str(work / "omp_reporter.py"), "--sample-input", str(work / "sample.json"),
        "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    proc = ServerProcess(store, "--workers", "1", "--intra-op-threads", "1").start()
    yield proc
    proc.stop()


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or "OMP_NUM_THREADS" in os.environ,
    reason="OpenMP's default must be more than one thread to tell 1 from it",
)
def test_the_worker_thread_uses_its_intra_op_threads(server: ServerProcess) -> None:
    reply = httpx.post(f"{server.url}/predictions/omp", json=[0.5] * 8, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"omp": 1, "torch": 1}
