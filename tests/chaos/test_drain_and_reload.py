"""SIGTERM under load drains and exits 0 with no process left behind; a failing reload keeps the
previous version serving; the registered models come back from the snapshot at the next start."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import psutil
import pytest
from hardening import archive
from serving import ServerProcess

from scriptserve.server.models import snapshot
from scriptserve.server.settings import load_settings

# Slow: workers failing and servers draining under load.
pytestmark = pytest.mark.slow

REFUSED = "refused"


async def _load_then_sigterm(
    server: ServerProcess,
) -> tuple[list[int | str], list[int | str], float]:
    url = f"{server.url}/predictions/slow"
    async with httpx.AsyncClient(timeout=60) as client:
        inflight = [
            asyncio.create_task(client.post(url, json=[float(i)] + [0.0] * 7)) for i in range(4)
        ]
        # Wait until all four are accepted (one running per worker, the rest queued).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = await client.get(f"{server.mgmt}/models/slow", headers=server.mgmt_headers)
            if r.json()[0]["jobQueueStatus"]["inFlightRequests"] == 4:
                break
            await asyncio.sleep(0.02)
        assert server.proc is not None
        server.proc.terminate()
        sent = time.monotonic()
        # The listeners close when the drain starts: a probe or request on a new connection is
        # refused (nothing was sent, so nothing is lost); one on an open connection gets 503.
        ready: list[int | str] = []
        while not ready or ready[-1] == 200:
            try:
                ready.append((await client.get(f"{server.url}/v2/health/ready")).status_code)
            except httpx.ConnectError:
                ready.append(REFUSED)
        flipped = time.monotonic() - sent
        try:
            late: int | str = (await client.post(url, json=[9.0] + [0.0] * 7)).status_code
        except httpx.ConnectError:
            late = REFUSED
        codes = [r.status_code for r in await asyncio.gather(*inflight)]
        return [*codes, late], ready, flipped


def test_sigterm_under_load_drains(slow_store: Path, tmp_path: Path) -> None:
    run_log = tmp_path / "runs.log"
    server = ServerProcess(
        slow_store,
        "--workers",
        "2",
        "--drain-timeout",
        "30",
        env={"RUN_LOG": str(run_log), "SLEEP_S": "0.7"},
    ).start()
    assert server.proc is not None
    process = psutil.Process(server.proc.pid)
    try:
        codes, ready, flipped = asyncio.run(_load_then_sigterm(server))
        children = process.children(recursive=True)
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    assert codes[:4] == [200, 200, 200, 200]  # every accepted request finished
    assert codes[4] in (503, REFUSED)  # a new one during the drain is refused
    assert ready[-1] in (503, REFUSED) and flipped < 2.0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert "stopped" in server.output()


def test_failing_reload_keeps_v1_and_snapshot_restores(tmp_path: Path) -> None:
    store = tmp_path / "store"
    archive(store, tmp_path / "work", "tiny")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('broken on purpose')\n")
    bad = archive(tmp_path / "v2", tmp_path / "work", "tiny", version="2.0", handler=str(broken))
    shutil.copy(bad, store / "tiny_v2.mar")
    server = ServerProcess(store, "--enable-model-api", "--workers", "1").start()
    mgmt, headers = server.mgmt, server.mgmt_headers
    try:
        r = httpx.post(f"{mgmt}/models", params={"url": "tiny_v2.mar"}, headers=headers, timeout=60)
        assert r.status_code == 400, r.text
        assert "failed to load" in r.json()["message"]
        assert httpx.post(f"{server.url}/predictions/tiny", json=[0.5] * 8).status_code == 200
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
        # A second name for the same archive, with its own settings: recorded in the snapshot.
        params = {"url": "tiny.mar", "model_name": "copy", "batch_size": "4", "synchronous": "true"}
        r = httpx.post(f"{mgmt}/models", params=params, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.put(
            f"{mgmt}/models/copy",
            params={"min_worker": 2, "synchronous": "true"},
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    # One snapshot per replica, named after it (the host name here).
    assert [p.name for p in (store / ".snapshot").glob("*.json")] == [
        f"models-{snapshot.replica_id(load_settings())}.json"
    ]
    restarted = ServerProcess(store).start()
    try:
        r = httpx.get(f"{restarted.mgmt}/models/copy", headers=restarted.mgmt_headers)
        (described,) = r.json()
        assert (described["batchSize"], len(described["workers"])) == (4, 2)
        assert httpx.post(f"{restarted.url}/predictions/copy", json=[0.5] * 8).status_code == 200
    finally:
        restarted.stop()
    fresh = ServerProcess(store, "--no-snapshot").start()
    try:
        r = httpx.get(f"{fresh.mgmt}/models/copy", headers=fresh.mgmt_headers)
        assert r.status_code == 404
    finally:
        fresh.stop()
