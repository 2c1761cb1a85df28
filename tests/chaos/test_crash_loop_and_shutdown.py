"""A worker that keeps dying is restarted with growing back-off, then the model is marked FAILED
(no restart loop); so is a thread-mode model with too many stuck threads. SIGTERM ends process
workers with the server, leaving no orphan."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from chaos.chaoskit import (
    KILL,
    SLEEP,
    build_archive,
    describe,
    infer,
    metric,
    models_dir,
    output,
    poll,
    row,
    status,
    worker_pids,
)
from serving import ServerProcess
from testmodels import reference_output

# Slow: workers failing and servers draining under load.
pytestmark = pytest.mark.slow

BACKOFF_S = 0.3
MAX_RESTARTS = 3


def test_repeated_worker_failures_back_off_then_mark_only_that_model_failed(
    tmp_path: Path,
) -> None:
    store, work = tmp_path / "store", tmp_path / "src"
    ts, _ = models_dir(tmp_path)
    start_log, crash_flag = tmp_path / "starts.log", tmp_path / "crash.flag"
    config = {
        "workerMode": "process",
        "minWorkers": 1,
        "startLog": str(start_log),
        "crashFlag": str(crash_flag),
    }
    build_archive(store, work, "crashy", ts, config)
    build_archive(store, work, "steady", ts, {"workerMode": "process", "minWorkers": 1})
    build_archive(store, work, "hangs", ts, {"minWorkers": 1, "responseTimeout": 0.5})
    env = {
        "SCRIPTSERVE_MAX_ABANDONED_THREADS": "1",
        "SCRIPTSERVE_WORKER_RESTART_BACKOFF_S": str(BACKOFF_S),
        "SCRIPTSERVE_WORKER_MAX_RESTARTS": str(MAX_RESTARTS),
        "SCRIPTSERVE_WORKER_RESTART_WINDOW_S": "120",
    }
    server = ServerProcess(store, "--workers", "1", env=env).start(timeout_s=180)
    try:
        assert len(start_log.read_text().splitlines()) == 1
        crash_flag.touch()  # from now on, every new worker dies while loading
        response = infer(server, "crashy", row(KILL))
        assert response.status_code == 503
        assert (
            "worker for model 'crashy' died (killed by signal 9 (SIGKILL))"
            in (response.json()["error"])
        )

        poll(lambda: describe(server, "crashy")["state"] == "FAILED", what="model FAILED")
        description = describe(server, "crashy")
        assert description["reason"].startswith(f"{MAX_RESTARTS + 1} worker failures within 120 s")
        assert "exited with code 3 while loading the model" in description["reason"]

        # The first crash and one per failed replacement, each after a longer back-off.
        starts = [float(line.split()[0]) for line in start_log.read_text().splitlines()]
        assert len(starts) == 1 + MAX_RESTARTS
        gaps = np.diff(starts[1:])
        for i, gap in enumerate(gaps):
            assert gap >= BACKOFF_S * 2 ** (i + 1) * 0.9, gaps
        # Failed for good: no further attempt, however long one waits for it.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert len(start_log.read_text().splitlines()) == 1 + MAX_RESTARTS
            time.sleep(0.1)

        failed = infer(server, "crashy", row(seed=1))
        assert failed.status_code == 503
        assert failed.json()["error"].startswith("model 'crashy' failed: 4 worker failures")
        assert status(server, "/v2/health/ready") == 503
        assert status(server, "/v2/models/crashy/ready") == 503
        # Only that model: the other one still serves.
        x = row(seed=2)
        np.testing.assert_allclose(
            output(infer(server, "steady", x)), reference_output(x), atol=1e-5
        )
        assert metric(server, "scriptserve_worker_restarts_total", model="crashy") == 0
        assert metric(server, "scriptserve_model_state", model="crashy", state="FAILED") == 1

        # Thread mode: each stuck thread is replaced, up to max_abandoned_threads (1) at once.
        assert infer(server, "hangs", row(SLEEP, 30.0)).status_code == 504
        poll(lambda: metric(server, "scriptserve_workers_stuck_total", model="hangs") == 1)
        x = row(seed=3)
        np.testing.assert_allclose(
            output(infer(server, "hangs", x)), reference_output(x), atol=1e-5
        )
        assert infer(server, "hangs", row(SLEEP, 30.0)).status_code == 504
        poll(lambda: describe(server, "hangs")["state"] == "FAILED", what="thread model FAILED")
        assert describe(server, "hangs")["reason"] == (
            "2 worker threads are stuck in the handler past the response timeout of 0.5 s"
        )
        refused = infer(server, "hangs", row(seed=4))
        assert refused.status_code == 503
        assert refused.json()["error"].startswith("model 'hangs' failed: 2 worker threads")
        np.testing.assert_allclose(
            output(infer(server, "steady", x)), reference_output(x), atol=1e-5
        )
    finally:
        server.stop()


def test_sigterm_drains_then_ends_process_workers_without_orphans(tmp_path: Path) -> None:
    store, work = tmp_path / "store", tmp_path / "src"
    ts, onnx = models_dir(tmp_path)
    build_archive(store, work, "slow", ts, {"workerMode": "process", "minWorkers": 2})
    build_archive(store, work, "tiny_onnx", onnx, {"workerMode": "process"}, chaos=False)
    server = ServerProcess(store, "--workers", "2").start(timeout_s=180)
    assert server.proc is not None
    workers = worker_pids(server, "slow") + worker_pids(server, "tiny_onnx")
    assert len(workers) == 4
    children = psutil.Process(server.proc.pid).children(recursive=True)

    # A request in flight when SIGTERM arrives still gets its answer.
    result: dict[str, httpx.Response] = {}
    x = row(seed=9)
    x[0, 0], x[0, 1] = SLEEP, 1.5
    thread = threading.Thread(target=lambda: result.update(r=infer(server, "slow", x)))
    thread.start()
    poll(lambda: any(w["status"] == "BUSY" for w in describe(server, "slow")["workers"]))
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    thread.join(30)
    assert result["r"].status_code == 200
    np.testing.assert_allclose(output(result["r"]), reference_output(x), atol=1e-5)

    # Every child (workers, and multiprocessing's resource tracker) is gone, none reparented.
    poll(
        lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
        timeout_s=30,
        what="no process left behind",
    )
    assert "stopped" in server.output()


def test_workers_end_when_the_server_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the server no time to end anything: each worker sees its server go (its
    parent is the fork server, which outlives the server only as long as a worker does)."""
    store, work = tmp_path / "store", tmp_path / "src"
    ts, _ = models_dir(tmp_path)
    build_archive(store, work, "slow", ts, {"workerMode": "process", "minWorkers": 2})
    server = ServerProcess(store, "--workers", "2").start(timeout_s=180)
    assert server.proc is not None
    workers = worker_pids(server, "slow")
    assert len(workers) == 2
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert {psutil.Process(pid).ppid() for pid in workers} != {server.proc.pid}  # the fork server

    # One worker in the middle of a handler call: it ends too, without finishing it.
    x = row(seed=5)
    x[0, 0], x[0, 1] = SLEEP, 60.0
    failed: list[Exception] = []

    def asked() -> None:
        try:
            infer(server, "slow", x)
        except httpx.TransportError as exc:
            failed.append(exc)

    thread = threading.Thread(target=asked)
    thread.start()
    poll(lambda: any(w["status"] == "BUSY" for w in describe(server, "slow")["workers"]))
    server.proc.kill()
    server.proc.wait(10)
    thread.join(10)
    assert len(failed) == 1  # the connection went with the server
    poll(
        lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
        timeout_s=10,
        what="every worker and the fork server gone",
    )


def test_workers_are_replaced_when_their_fork_server_is_killed(tmp_path: Path) -> None:
    """The fork server reports each worker's exit: killed, it makes every worker it forked look
    ended. Each is ended for good (none left running beside its replacement, even one in the
    middle of a handler call) and replaced from a new fork server."""
    store, work = tmp_path / "store", tmp_path / "src"
    ts, _ = models_dir(tmp_path)
    build_archive(store, work, "slow", ts, {"workerMode": "process", "minWorkers": 2})
    server = ServerProcess(store, "--workers", "2").start(timeout_s=180)
    try:
        old = worker_pids(server, "slow")
        (fork_server,) = {psutil.Process(pid).ppid() for pid in old}
        busy = row(seed=6)
        busy[0, 0], busy[0, 1] = SLEEP, 60.0
        answers: dict[str, httpx.Response] = {}
        thread = threading.Thread(target=lambda: answers.update(r=infer(server, "slow", busy)))
        thread.start()
        poll(lambda: any(w["status"] == "BUSY" for w in describe(server, "slow")["workers"]))

        psutil.Process(fork_server).kill()
        thread.join(30)
        assert answers["r"].status_code == 503
        assert "died (lost with its fork server" in answers["r"].json()["error"]
        poll(
            lambda: (
                status(server, "/v2/models/slow/ready") == 200
                and len(worker_pids(server, "slow")) == 2
                and not set(worker_pids(server, "slow")) & set(old)
            ),
            what="two new workers",
        )
        poll(
            lambda: not any(psutil.pid_exists(pid) for pid in old),
            timeout_s=10,
            what="the old workers gone",
        )
        new = worker_pids(server, "slow")
        assert {psutil.Process(pid).ppid() for pid in new} != {fork_server}
        x = row(seed=7)
        np.testing.assert_allclose(output(infer(server, "slow", x)), reference_output(x), atol=1e-5)
    finally:
        server.stop()


_CANNOT_START = "replacement worker failed: the worker process could not be started"


def test_a_worker_that_cannot_be_started_is_tried_again(tmp_path: Path) -> None:
    """Starting a worker can fail before any process exists (here: the server out of file
    descriptors, so no pipe to a worker can be made). Scaling up then fails with that reason
    and keeps the workers it had; a replacement counts as failed and is tried again after the
    back-off, so the worker comes back once descriptors are free."""
    store, work = tmp_path / "store", tmp_path / "src"
    ts, _ = models_dir(tmp_path)
    build_archive(store, work, "slow", ts, {"workerMode": "process", "minWorkers": 1})
    env = {"SCRIPTSERVE_WORKER_RESTART_BACKOFF_S": "0.2", "SCRIPTSERVE_WORKER_MAX_RESTARTS": "50"}
    server = ServerProcess(store, "--workers", "1", env=env).start(timeout_s=180)
    try:
        assert server.proc is not None
        process = psutil.Process(server.proc.pid)
        (old,) = worker_pids(server, "slow")
        limits = process.rlimit(psutil.RLIMIT_NOFILE)
        with httpx.Client(base_url=server.mgmt, headers=server.mgmt_headers, timeout=30) as mgmt:
            assert mgmt.get("/models/slow").status_code == 200  # its connection, kept open
            process.rlimit(psutil.RLIMIT_NOFILE, (process.num_fds(), limits[1]))
            try:
                params = {"min_worker": 2, "synchronous": "true"}
                scaled = mgmt.put("/models/slow", params=params)
                psutil.Process(old).kill()
                poll(
                    lambda: server.output().count(_CANNOT_START) >= 2,
                    what="replacements failing, one after another",
                )
            finally:
                process.rlimit(psutil.RLIMIT_NOFILE, limits)
        assert scaled.status_code == 500
        assert scaled.json()["message"] == (
            "model 'slow' version 1.0 could not start a worker: a worker process could not be "
            "started (Too many open files); it keeps its 1 worker(s)"
        )
        poll(
            lambda: [w["status"] for w in describe(server, "slow")["workers"]] == ["READY"],
            what="the worker back, and only it",
        )
        assert worker_pids(server, "slow") != [old]
        x = row(seed=8)
        np.testing.assert_allclose(output(infer(server, "slow", x)), reference_output(x), atol=1e-5)
    finally:
        server.stop()
