"""WorkerPool with process workers, driven in-process: a real child process loads a real
TorchScript archive, serves it, is replaced when it dies or hangs, and leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import psutil
import pytest
from testmodels import reference_output

from scriptserve.archiver.archive import open_archive
from scriptserve.handlers.base import Context, InferenceRequest, InferenceResponse
from scriptserve.handlers.loader import read_model_config
from scriptserve.server.errors import DeadlineExceeded, InferenceFailed, ModelNotReady
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.workers import RestartPolicy, build_pool
from scriptserve.server.workers.batching import DynamicBatcher, Job

# Slow: worker processes started, killed and hung.
pytestmark = [pytest.mark.slow, pytest.mark.anyio]

START_S = 120.0
"""A new worker process imports torch and loads the model: seconds, more on a busy machine."""
RESPONSE_TIMEOUT_S = 2.0
SLEEP, FAIL, CRASH = 1234.0, 13.0, 66.0

HANDLER = """
import ctypes
import time

from scriptserve.handlers.tensor import TensorHandler


class Sleepy(TensorHandler):
    def handle(self, requests, context):
        for request in requests:
            x = request.inputs["x"]
            if float(x.flat[0]) == 1234.0:
                time.sleep(float(x.flat[1]))
            if float(x.flat[0]) == 13.0:
                raise ValueError("cannot read /opt/models/secret-weights.pt")
            if float(x.flat[0]) == 66.0:
                ctypes.string_at(0)  # native code reading through a null pointer: SIGSEGV
        return super().handle(requests, context)
"""


def request(first: float = 0.0, second: float = 0.0, seed: int = 0) -> InferenceRequest:
    x = np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32)
    if first:
        x[0, :2] = first, second
    return InferenceRequest(inputs={"x": x})


def submit(batcher: DynamicBatcher, req: InferenceRequest) -> Job:
    loop = asyncio.get_running_loop()
    job = Job(req, loop.create_future(), deadline=time.monotonic() + 60)
    batcher.put(job)
    return job


async def answer(job: Job, timeout_s: float = 30.0) -> InferenceResponse:
    return await asyncio.wait_for(job.future, timeout_s)


async def until(check: Callable[[], object], what: str, timeout_s: float = START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.02)


def served_right(response: InferenceResponse, req: InferenceRequest) -> bool:
    (y,) = response.outputs.values()
    return bool(np.allclose(y, reference_output(req.inputs["x"]), atol=1e-5))


async def test_a_worker_process_serves_is_replaced_when_it_dies_or_hangs_and_stops_clean(
    tmp_path: Path,
    make_archive: Callable[..., Path],
    torchscript_file: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    handler = tmp_path / "sleepy_handler.py"
    handler.write_text(textwrap.dedent(HANDLER))
    reader = open_archive(make_archive(torchscript_file, handler=str(handler)))
    context = Context(
        model_name="tiny",
        model_version="1.0",
        model_dir=reader.root,
        manifest=reader.manifest,
        model_config=read_model_config(reader.root, reader.manifest),
    )
    batcher = DynamicBatcher(max_batch_size=4, max_batch_delay_s=0.0, max_queue_size=16)
    metrics = ServerMetrics()
    pool = build_pool(
        mode="process",
        context=context,
        batcher=batcher,
        devices=["cpu"],
        metrics=metrics.for_version("tiny", "1.0"),
        response_timeout_s=RESPONSE_TIMEOUT_S,
        policy=RestartPolicy(backoff_s=0.1, stop_grace_s=2.0),
        max_abandoned=4,
    )
    try:
        await asyncio.to_thread(pool.scale, 1)
        (slot,) = pool.slots()
        (described,) = pool.describe()
        first_pid = slot.pid
        assert first_pid is not None and first_pid != os.getpid()
        assert (described["pid"], described["mode"], described["status"]) == (
            first_pid,
            "process",
            "READY",
        )
        req = request(seed=1)
        assert served_right(await answer(submit(batcher, req)), req)

        # A handler exception in the worker process: the client learns its class, no more.
        failing = request(FAIL)
        with pytest.raises(InferenceFailed) as failed:
            await answer(submit(batcher, failing))
        assert failed.value.message == (
            f"the handler failed: ValueError (request id {failing.request_id}); see the server log"
        )

        # Killed mid-request: that request fails at once (503), the worker comes back.
        sleeper = submit(batcher, request(SLEEP, 30.0))
        await until(lambda: pool.counts()["BUSY"] == 1, "the worker busy")
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(ModelNotReady) as died:
            await answer(sleeper, timeout_s=10.0)
        assert died.value.message == (
            "worker for model 'tiny' died (killed by signal 9 (SIGKILL)) while running this "
            "request; retry"
        )
        await until(lambda: pool.live == 1, "a new worker process")
        second_pid = slot.pid
        assert second_pid not in (None, first_pid)
        req = request(seed=2)
        assert served_right(await answer(submit(batcher, req)), req)

        # A crash in native code (a compiled model's, say): the request is told its worker died
        # of SIGSEGV, and the server's stderr holds the worker's Python stack where it crashed.
        capfd.readouterr()
        with pytest.raises(ModelNotReady) as crashed:
            await answer(submit(batcher, request(CRASH)), timeout_s=10.0)
        assert "died (killed by signal 11 (SIGSEGV))" in crashed.value.message
        report = capfd.readouterr().err
        assert "Fatal Python error: Segmentation fault" in report and "in handle" in report
        await until(lambda: pool.live == 1 and slot.pid != second_pid, "a worker after the crash")
        second_pid = slot.pid

        # Hung past the response timeout: 504 on time, killed, replaced.
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await answer(submit(batcher, request(SLEEP, 3600.0)))
        assert time.monotonic() - started < RESPONSE_TIMEOUT_S + 5.0
        await until(lambda: pool.live == 1 and slot.pid != second_pid, "a worker after the hang")
        assert not psutil.pid_exists(second_pid) or psutil.Process(second_pid).status() == (
            psutil.STATUS_ZOMBIE
        )
        req = request(seed=3)
        assert served_right(await answer(submit(batcher, req)), req)
        labels = {"model": "tiny", "version": "1.0"}
        restarts = metrics.registry.get_sample_value("scriptserve_worker_restarts_total", labels)
        assert restarts == 3
        last_pid = slot.pid
        segments = [slot.requests.name, slot.responses.name]
    finally:
        await asyncio.to_thread(pool.stop, 5.0)
        reader.close()

    # Nothing left behind: no worker process, no shared-memory segment.
    assert last_pid is not None
    assert not psutil.pid_exists(last_pid) or psutil.Process(last_pid).status() == (
        psutil.STATUS_ZOMBIE
    )
    for name in segments:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    assert (pool.size, pool.live) == (0, 0)
