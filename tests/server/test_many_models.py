"""Many models on one node: lazy loading, a memory budget, eviction of the least recently used
idle model, and nothing lost while models come and go (server/models/memory.py).

Each model is a TorchScript archive holding `MODEL_MIB` MiB of weights and answering its own
number, so an answer says which model gave it. Real servers on loopback ports, thread workers
(one per model) unless a test says otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from serving import ServerProcess
from tritonclient.utils import InferenceServerException

from benchmarks.models import build_holders

# Slow: five servers, one of them under 32 clients for 8 s (test_memory.py is the quick loop's).
pytestmark = pytest.mark.slow

MODEL_MIB = 96
"""Large enough that half a model (the margin of a budget of 2.5 models on either side of "two
fit, three do not") is more than a server's resident size varies from one start to the next:
the budgets are set from another server's sizes (`sizes`). At 48 MiB, one run in five loaded a
third model without unloading one."""
MODELS = 6


def fresh_server(store: Path, *args: str, **kwargs: Any) -> ServerProcess:
    """A server started as a process of its own (serving.ServerProcess's `fresh`): these tests
    budget the resident memory it measures."""
    return ServerProcess(store, *args, fresh=True, **kwargs)


LAZY = ("--lazy-load", "--workers", "1", "--no-snapshot")
"""Every model lazy, one thread worker each; each server starts from the store alone."""


def infer(client: httpx.Client, server: ServerProcess, name: str, **headers: str) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
    return client.post(f"{server.url}/v2/models/{name}/infer", json=body, headers=headers)


def answer(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["outputs"][0]["data"][0])


def memory(client: httpx.Client, server: ServerProcess, name: str) -> dict[str, object]:
    described = client.get(f"{server.mgmt}/models/{name}", headers=server.mgmt_headers)
    assert described.status_code == 200, described.text
    found: dict[str, object] = described.json()[0]["memory"]
    return found


def metric(client: httpx.Client, server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (every sample: none given)."""
    text = client.get(f"{server.metrics_url}/metrics").text
    total = 0.0
    for found in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(found.group(2))
    return total


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Stored, not deflated: random weights do not compress (13 s to try for six, against 1.4).
    return build_holders(
        tmp_path_factory.mktemp("many"), [MODEL_MIB] * MODELS, archive_format="zip-store"
    )


@pytest.fixture(scope="module")
def sizes(store: Path) -> tuple[int, int]:
    """What a server without a budget measures on this machine: its resident size with no
    model (with what its first load sets up once: kernels, thread pools), and one model's
    bytes."""
    proc = fresh_server(store, *LAZY).start()
    try:
        with httpx.Client(timeout=60) as client:
            assert answer(infer(client, proc, "m0")) == 0
            assert answer(infer(client, proc, "m1")) == 1
            proc.wait(lambda c: memory(c, proc, "m1")["residence"] == "LOADED", 10)
            held = int(metric(client, proc, "scriptserve_memory_resident_bytes"))
            resident = int(memory(client, proc, "m1")["residentBytes"])  # type: ignore[call-overload]
    finally:
        proc.stop()
    assert resident >= MODEL_MIB * 2**20 * 0.8, resident  # the weights are what it holds
    return held - 2 * resident, resident


def budget_for(sizes: tuple[int, int], models: float) -> str:
    base, resident = sizes
    return str(int(base + models * resident))


@pytest.fixture(scope="module")
def lazy_server(store: Path) -> Iterator[ServerProcess]:
    proc = fresh_server(store, *LAZY, "--enable-model-api").start()
    yield proc
    proc.stop()


def test_a_lazy_model_is_registered_ready_and_loads_on_its_first_request(
    lazy_server: ServerProcess,
) -> None:
    with httpx.Client(timeout=60) as client:
        assert client.get(f"{lazy_server.url}/v2/health/ready").status_code == 200
        before = memory(client, lazy_server, "m1")
        assert before["residence"] == "UNLOADED" and before["residentBytes"] == 0
        assert before["load"] == "lazy" and before["evictable"] is True
        index = client.post(
            f"{lazy_server.url}/v2/repository/index", json={}, headers=lazy_server.mgmt_headers
        ).json()
        entry = next(e for e in index if e["name"] == "m1")
        assert entry["state"] == "READY" and "not loaded" in entry["reason"]
        meta = client.get(f"{lazy_server.url}/v2/models/m1").json()
        assert meta["parameters"]["residence"] == "UNLOADED"
        assert client.get(f"{lazy_server.url}/v2/models/m1/ready").status_code == 200

        assert answer(infer(client, lazy_server, "m1")) == 1

        # Served by its first worker up; the load's measuring ends just after.
        lazy_server.wait(lambda c: memory(c, lazy_server, "m1")["residence"] == "LOADED", 10)
        after = memory(client, lazy_server, "m1")
        assert after["residence"] == "LOADED" and after["loads"] == 1
        assert int(after["residentBytes"]) >= MODEL_MIB * 2**20 * 0.8  # type: ignore[call-overload]
        labels = {"model": "m1", "version": "1.0"}
        assert metric(client, lazy_server, "scriptserve_model_loads_total", **labels) == 1
        assert metric(client, lazy_server, "scriptserve_model_load_waits_total", **labels) == 1
        assert metric(client, lazy_server, "scriptserve_model_load_seconds_count") >= 1
        resident = metric(client, lazy_server, "scriptserve_model_resident_bytes", **labels)
        assert resident == after["residentBytes"]
        assert answer(infer(client, lazy_server, "m1")) == 1  # loaded now: no wait
        assert metric(client, lazy_server, "scriptserve_model_load_waits_total", **labels) == 1


def test_requests_that_arrive_while_a_model_loads_wait_for_that_one_load(
    lazy_server: ServerProcess,
) -> None:
    async def burst() -> list[httpx.Response]:
        body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
        async with httpx.AsyncClient(timeout=60) as client:
            url = f"{lazy_server.url}/v2/models/m2/infer"
            return await asyncio.gather(*(client.post(url, json=body) for _ in range(24)))

    responses = asyncio.run(burst())
    assert [answer(r) for r in responses] == [2] * 24
    with httpx.Client(timeout=10) as client:
        labels = {"model": "m2", "version": "1.0"}
        assert metric(client, lazy_server, "scriptserve_model_loads_total", **labels) == 1
        assert metric(client, lazy_server, "scriptserve_model_load_waits_total", **labels) >= 1


def test_registration_says_lazy_or_eager_and_pinned(lazy_server: ServerProcess) -> None:
    with httpx.Client(timeout=60) as client:
        headers = lazy_server.mgmt_headers
        url = f"{lazy_server.mgmt}/models"
        params = {"url": "m3.mar", "model_name": "m3eager", "load": "eager", "evictable": "false"}
        registered = client.post(url, params=params, headers=headers)
        assert registered.status_code == 200, registered.text
        described = memory(client, lazy_server, "m3eager")
        assert described["residence"] == "LOADED" and described["load"] == "eager"
        assert described["evictable"] is False
        refused = client.post(url, params={"url": "m3.mar", "load": "later"}, headers=headers)
        assert refused.status_code == 400 and "load" in refused.text
        gone = client.delete(f"{url}/m3eager", headers=headers)  # out of the store's snapshot
        assert gone.status_code == 200, gone.text


def unloads_in_lru_order(log: str, requests: list[tuple[str, int]]) -> None:
    """Each unload in the server's `log` took the least recently requested model loaded at
    that moment: `requests` are the models asked for one at a time, in order, each with the
    length the log had once it was answered (what its load unloaded was logged before)."""
    loaded: list[str] = []  # least recently used first
    start = 0
    for name, end in requests:
        for model, event in re.findall(
            r"model=(m\d) version=1\.0 (loaded|unloaded)", log[start:end]
        ):
            if event == "unloaded":
                others = [m for m in loaded if m != name]
                assert others and model == others[0], (name, model, loaded)
                loaded.remove(model)
        if name in loaded:
            loaded.remove(name)
        loaded.append(name)
        start = end


def test_the_least_recently_used_idle_model_is_unloaded_to_make_room(
    store: Path, sizes: tuple[int, int]
) -> None:
    """A budget for 2.5 models: m1, the least recently used, makes room for m2 (or for m3,
    where a server that started smaller than the `sizes` one holds three), m0 does not. The
    heap's drift counts too (server/models/memory.py): where it left room for fewer models,
    more are unloaded, each the least recently used one at the time."""
    budget = budget_for(sizes, 2.5)
    proc = fresh_server(store, *LAZY, "--memory-budget", budget)
    proc.start()
    try:
        with httpx.Client(timeout=60) as client:
            requests = []
            for name in ("m0", "m1", "m0", "m2", "m0", "m3"):
                assert answer(infer(client, proc, name)) == int(name[1:])
                requests.append((name, len(proc.output())))
            assert memory(client, proc, "m1")["residence"] == "UNLOADED"
            unloads_in_lru_order(proc.output(), requests)
            labels = {"model": "m1", "version": "1.0"}
            assert metric(client, proc, "scriptserve_model_evictions_total", **labels) == 1
            assert metric(client, proc, "scriptserve_model_resident_bytes", **labels) == 0
            assert answer(infer(client, proc, "m1")) == 1  # reloaded on its next request
            proc.wait(lambda c: memory(c, proc, "m1")["loads"] == 2, 10)
            used = metric(client, proc, "scriptserve_memory_accounted_bytes")
            assert used <= int(budget)
            resident = metric(client, proc, "scriptserve_memory_resident_bytes")
            assert resident <= int(budget) * 1.1
            assert metric(client, proc, "scriptserve_memory_budget_bytes") == int(budget)
            assert client.get(f"{proc.url}/v2/health/ready").status_code == 200
    finally:
        proc.stop()


def test_a_pinned_model_stays_and_a_full_budget_answers_503(
    store: Path, sizes: tuple[int, int], tmp_path: Path
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model_defaults:\n  m0:\n    '*': {evictable: false}\n  m1:\n    '*': {evictable: false}\n"
    )
    budget = budget_for(sizes, 2.5)
    proc = fresh_server(
        store,
        *LAZY,
        "--memory-budget",
        budget,
        env={"SCRIPTSERVE_CONFIG_FILE": str(config)},
    )
    proc.start()
    try:
        with httpx.Client(timeout=60) as client:
            assert answer(infer(client, proc, "m0")) == 0
            assert answer(infer(client, proc, "m1")) == 1
            full = infer(client, proc, "m2")
            assert full.status_code == 503, full.text
            assert "memory budget is full" in full.json()["error"]
            assert "--memory-budget" in full.json()["error"]
            assert memory(client, proc, "m0")["residence"] == "LOADED"
            assert memory(client, proc, "m2")["residence"] == "UNLOADED"
            assert answer(infer(client, proc, "m0")) == 0  # the others serve on
            assert client.get(f"{proc.url}/v2/health/ready").status_code == 200
    finally:
        proc.stop()


def test_zipf_traffic_over_more_models_than_fit_loses_nothing(
    store: Path, sizes: tuple[int, int]
) -> None:
    """32 clients of 5 requests each, model i chosen with weight 1/(i+1)^1.1, a budget for 3 of
    the 6: every request answered 200 by the model it named, while models are evicted and
    reloaded. The clients send a number of requests, not for a time: a loaded machine makes the
    run longer, not the check weaker."""
    budget = budget_for(sizes, 3.5)
    proc = fresh_server(store, *LAZY, "--memory-budget", budget)
    proc.start()
    weights = [1 / (i + 1) ** 1.1 for i in range(MODELS)]
    outcomes: list[tuple[int, int, int]] = []

    async def client_loop(client: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
        for i in rng.choices(range(MODELS), weights, k=5):
            response = await client.post(f"{proc.url}/v2/models/m{i}/infer", json=body)
            got = int(response.json()["outputs"][0]["data"][0]) if response.is_success else -1
            outcomes.append((i, response.status_code, got))

    async def traffic() -> None:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(client_loop(client, random.Random(seed)) for seed in range(32)))

    try:
        asyncio.run(traffic())
        with httpx.Client(timeout=10) as client:
            evictions = metric(client, proc, "scriptserve_model_evictions_total")
            loads = metric(client, proc, "scriptserve_model_loads_total")
            used = metric(client, proc, "scriptserve_memory_accounted_bytes")
            resident = metric(client, proc, "scriptserve_memory_resident_bytes")
            assert client.get(f"{proc.url}/v2/health/ready").status_code == 200
    finally:
        proc.stop()
    failed = [o for o in outcomes if o[1] != 200 or o[0] != o[2]]
    assert not failed, failed[:5]
    assert len(outcomes) == 32 * 5
    assert len({o[0] for o in outcomes}) == MODELS  # the seeds name every model
    assert evictions >= 1 and loads >= MODELS  # models came and went
    assert used <= int(budget)
    assert resident <= int(budget) * 1.1


PROCESS = (*LAZY, "--worker-mode", "process")


@pytest.fixture(scope="module")
def process_sizes(store: Path) -> tuple[int, int]:
    """What a server with process workers and no budget measures: what it holds beyond its one
    model (the server process before any model, and the fork server) and that model's worker
    process."""
    sizing = fresh_server(store, *PROCESS).start()
    try:
        with httpx.Client(timeout=120) as client:
            assert answer(infer(client, sizing, "m0")) == 0
            sizing.wait(lambda c: memory(c, sizing, "m0")["residence"] == "LOADED", 30)
            child = int(memory(client, sizing, "m0")["residentBytes"])  # type: ignore[call-overload]
            accounted = int(metric(client, sizing, "scriptserve_memory_accounted_bytes"))
    finally:
        sizing.stop()
    return accounted - child, child


def test_process_workers_count_their_own_process_and_are_stopped_to_make_room(
    store: Path, process_sizes: tuple[int, int]
) -> None:
    """A process worker counts its process (the weights, its share of the pages it shares with
    the fork server): the budget counts it so, and unloading a model stops its process."""
    baseline, child = process_sizes
    assert child > MODEL_MIB * 2**20  # the weights and a share of a Python process with torch

    budget = str(int(baseline + 1.5 * child))
    proc = fresh_server(store, *PROCESS, "--memory-budget", budget).start()
    try:
        with httpx.Client(timeout=120) as client:
            for name, ident in (("m0", 0), ("m1", 1), ("m0", 0), ("m1", 1)):
                assert answer(infer(client, proc, name)) == ident
            proc.wait(lambda c: memory(c, proc, "m1")["loads"] == 2, 30)
            assert memory(client, proc, "m0")["residence"] == "UNLOADED"
            assert memory(client, proc, "m0")["evictions"] == 2
            described = client.get(f"{proc.mgmt}/models/m0", headers=proc.mgmt_headers).json()
            assert described[0]["workers"] == []  # its process is gone
            assert metric(client, proc, "scriptserve_memory_accounted_bytes") <= int(budget)
    finally:
        proc.stop()


def test_a_model_running_a_request_is_waited_for_not_unloaded(
    tmp_path: Path, sizes: tuple[int, int]
) -> None:
    """Room for one model and a half: while s0 runs a long request, a request to s1 waits for
    s0 to finish rather than unloading it under its request; then s0 makes room."""
    store = build_holders(
        tmp_path, [MODEL_MIB] * 2, prefix="s", archive_format="zip-store", busy=2000
    )
    budget = budget_for(sizes, 1.5)
    proc = fresh_server(store, *LAZY, "--memory-budget", budget, "--no-warmup").start()
    try:
        with httpx.Client(timeout=120) as client:
            assert answer(infer(client, proc, "s0")) == 0  # loaded (and timed)
            started = time.perf_counter()
            assert answer(infer(client, proc, "s0")) == 0
            busy_s = time.perf_counter() - started
            assert busy_s > 0.3, busy_s  # long enough to be seen running

            async def both() -> tuple[httpx.Response, httpx.Response, float]:
                body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32"}]}
                body["inputs"][0]["data"] = [0.5] * 8
                async with httpx.AsyncClient(timeout=120) as http:
                    first = asyncio.ensure_future(
                        http.post(f"{proc.url}/v2/models/s0/infer", json=body)
                    )
                    await asyncio.sleep(busy_s / 4)  # s0 is running it now
                    asked = time.perf_counter()
                    second = await http.post(f"{proc.url}/v2/models/s1/infer", json=body)
                    return await first, second, time.perf_counter() - asked

            first, second, waited = asyncio.run(both())
            assert answer(first) == 0 and answer(second) == 1
            assert waited > busy_s / 2  # s1's load waited for s0's request to end
            assert memory(client, proc, "s0")["residence"] == "UNLOADED"
            labels = {"model": "s0", "version": "1.0"}
            assert metric(client, proc, "scriptserve_model_evictions_total", **labels) == 1
    finally:
        proc.stop()


def test_grpc_repository_and_snapshots_see_lazy_models(
    store: Path, sizes: tuple[int, int], tmp_path: Path
) -> None:
    """Triton's repository `load` loads a parked model without a request; over gRPC a full
    budget is UNAVAILABLE with its reason; a lazy registration outlives a restart (the
    replica's snapshot), still lazy and pinned."""
    args = (
        "--lazy-load", "--workers", "1", "--enable-model-api",
        "--snapshot-dir", str(tmp_path / "snapshots"), "--memory-budget", budget_for(sizes, 2.5),
    )  # fmt: skip
    x = triton_grpc.InferInput("x", [1, 8], "FP32")
    x.set_data_from_numpy(np.full((1, 8), 0.5, np.float32))
    proc = fresh_server(store, *args).start()
    try:
        headers = proc.mgmt_headers
        rpc = triton_grpc.InferenceServerClient(proc.grpc)
        with httpx.Client(timeout=60) as client, rpc:
            repository = triton_http.InferenceServerClient(proc.url.removeprefix("http://"))
            repository.load_model("m1", headers=headers)
            assert memory(client, proc, "m1")["residence"] == "LOADED"  # no request needed

            for name, archive in (("pinned", "m0.mar"), ("pinned2", "m2.mar")):
                params = {"url": archive, "model_name": name, "evictable": "false"}
                registered = client.post(f"{proc.mgmt}/models", params=params, headers=headers)
                assert registered.status_code == 200, registered.text
                assert memory(client, proc, name)["residence"] == "UNLOADED"  # lazy
            answered = rpc.infer("pinned", [x]).as_numpy("output0")
            assert answered is not None and int(answered[0, 0]) == 0
            assert answer(infer(client, proc, "pinned2")) == 2  # m1, idle, made room
            assert memory(client, proc, "m1")["residence"] == "UNLOADED"

            with pytest.raises(InferenceServerException) as full:
                rpc.infer("m3", [x])
            assert full.value.status() == "StatusCode.UNAVAILABLE"
            assert "memory budget is full" in str(full.value.message())
            assert rpc.is_server_ready()
    finally:
        proc.stop()
    restarted = fresh_server(store, *args).start()
    try:
        with httpx.Client(timeout=60) as client:
            again = memory(client, restarted, "pinned")
            assert again["residence"] == "UNLOADED" and again["evictable"] is False
            assert answer(infer(client, restarted, "pinned")) == 0
    finally:
        restarted.stop()


def test_a_request_waits_for_its_model_to_load_no_longer_than_its_deadline(
    tmp_path: Path,
) -> None:
    """A load that takes longer than a request's deadline answers that request 504 on time;
    the load goes on, and the next request is served by it."""
    store = build_holders(tmp_path, [4], prefix="w", busy=3000)  # warm-up: 2 long calls
    proc = fresh_server(store, *LAZY).start()
    try:
        with httpx.Client(timeout=60) as client:
            started = time.perf_counter()
            late = infer(client, proc, "w0", **{"X-Request-Timeout": "0.2"})
            waited = time.perf_counter() - started
            assert late.status_code == 504, late.text
            assert waited < 1.0, waited  # answered at its deadline, not at the load's end
            assert memory(client, proc, "w0")["residence"] == "LOADING"
            assert answer(infer(client, proc, "w0")) == 0  # the same load serves it
            proc.wait(lambda c: memory(c, proc, "w0")["residence"] == "LOADED", 30)
            labels = {"model": "w0", "version": "1.0"}
            assert metric(client, proc, "scriptserve_model_loads_total", **labels) == 1
    finally:
        proc.stop()


def _tree(root: int) -> list[int]:
    """`root` and every process descended from it."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


def _held(server: int) -> tuple[dict[int, tuple[int, int]], int]:
    """The resident and proportional sizes of `server` and every process descended from it, and
    what they hold together, shared pages once: the server's resident size and the others'
    proportional sizes."""
    sizes = {pid: _sizes(pid) for pid in _tree(server)}
    return sizes, sizes[server][0] + sum(pss for pid, (_, pss) in sizes.items() if pid != server)


def _sizes(pid: int) -> tuple[int, int]:
    """A process's resident and proportional sizes (0, 0 when it is gone)."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    fields = dict(line.split(":", 1) for line in rollup.splitlines()[1:] if ":" in line)
    return int(fields["Rss"].split()[0]) * 1024, int(fields["Pss"].split()[0]) * 1024


def test_process_workers_pages_shared_with_their_fork_server_are_counted_once(
    store: Path,
) -> None:
    """Four process workers of two models, forked from one fork server that imported torch:
    the budget's accounting and its resident figure both come within 15 % of what the server's
    process tree holds, shared pages once (the sum of its processes' proportional sizes, the
    server's own resident size), where adding up the workers' resident sizes counts the pages
    they share with the fork server four times."""
    proc = fresh_server(store, *PROCESS, "--workers", "2").start()
    try:
        with httpx.Client(timeout=120) as client:
            for name, ident in (("m0", 0), ("m1", 1)):
                assert answer(infer(client, proc, name)) == ident
                proc.wait(lambda c, n=name: memory(c, proc, n)["residence"] == "LOADED", 30)
            accounted = metric(client, proc, "scriptserve_memory_accounted_bytes")
            resident = metric(client, proc, "scriptserve_memory_resident_bytes")
            assert proc.proc is not None
            server = proc.proc.pid
            sizes, held = _held(server)
            counted_apart = sum(rss for rss, _ in sizes.values())
            described = client.get(f"{proc.mgmt}/models/m0", headers=proc.mgmt_headers).json()
            workers = [w["pid"] for w in described[0]["workers"]]
    finally:
        proc.stop()
    assert len(workers) == 2 and all(pid in sizes for pid in workers)
    assert 0.85 * held <= accounted <= 1.15 * held, (accounted, held)
    assert 0.85 * held <= resident <= 1.15 * held, (resident, held)
    assert counted_apart > 1.3 * held, (counted_apart, held)  # what sharing saves here


def test_a_fork_server_that_outlives_its_workers_is_still_counted(store: Path) -> None:
    """Process workers of two models, then the models unregistered: their fork server lives on
    and now holds alone the pages its workers shared with it. The budget's accounting and its
    resident figure still come within 15 % of what the server's process tree holds, where the
    fork server's last reading (its share while it had four children) or none at all would
    leave most of it out."""
    proc = fresh_server(store, *PROCESS, "--workers", "2", "--enable-model-api").start()
    try:
        with httpx.Client(timeout=120) as client:
            for name, ident in (("m0", 0), ("m1", 1)):
                assert answer(infer(client, proc, name)) == ident
                proc.wait(lambda c, n=name: memory(c, proc, n)["residence"] == "LOADED", 30)
            for name in ("m0", "m1"):
                gone = client.delete(f"{proc.mgmt}/models/{name}", headers=proc.mgmt_headers)
                assert gone.status_code == 200, gone.text
            accounted = metric(client, proc, "scriptserve_memory_accounted_bytes")
            resident = metric(client, proc, "scriptserve_memory_resident_bytes")
            assert proc.proc is not None
            server = proc.proc.pid
            sizes, held = _held(server)
    finally:
        proc.stop()
    fork_servers = [pid for pid, (_, pss) in sizes.items() if pid != server and pss > 0]
    assert fork_servers, sizes  # the fork server outlived its workers
    assert 0.85 * held <= accounted <= 1.15 * held, (accounted, held)
    assert 0.85 * held <= resident <= 1.15 * held, (resident, held)


def test_a_crashed_process_worker_leaves_its_models_accounting_at_once(store: Path) -> None:
    """Two process workers of m0, one killed and its replacement held back by its back-off: at
    the next scrape m0's resident bytes count the worker that lives, not the last reading of
    both (which the accounting kept until the next load or unload); once the replacement is
    up, two workers again."""
    backoff = {"SCRIPTSERVE_WORKER_RESTART_BACKOFF_S": "10"}
    proc = fresh_server(store, *PROCESS, "--workers", "2", env=backoff).start()

    def resident(client: httpx.Client) -> int:
        metric(client, proc, "scriptserve_memory_accounted_bytes")  # a scrape reads them
        return int(memory(client, proc, "m0")["residentBytes"])  # type: ignore[call-overload]

    def workers(client: httpx.Client) -> list[dict[str, Any]]:
        described = client.get(f"{proc.mgmt}/models/m0", headers=proc.mgmt_headers)
        found: list[dict[str, Any]] = described.json()[0]["workers"]
        return found

    try:
        with httpx.Client(timeout=120) as client:
            assert answer(infer(client, proc, "m0")) == 0
            proc.wait(lambda c: memory(c, proc, "m0")["residence"] == "LOADED", 30)
            both = resident(client)
            pids = [w["pid"] for w in workers(client)]
            os.kill(pids[0], signal.SIGKILL)
            proc.wait(lambda c: resident(c) < 0.9 * both, 8)
            one = resident(client)
            proc.wait(
                lambda c: {w["pid"] for w in workers(c) if w["status"] == "READY"} - set(pids),
                60,
            )
            again = resident(client)
    finally:
        proc.stop()
    assert 0.3 * both < one < 0.9 * both, (one, both)
    assert again > one and 0.75 * both < again < 1.25 * both, (again, one, both)


def test_zipf_traffic_with_process_workers_loses_nothing(
    store: Path, process_sizes: tuple[int, int]
) -> None:
    """8 clients of 6 requests each over 3 models (m0-m2) with process workers and room for 2
    worker processes: every request answered by the model it named while processes are stopped
    and started."""
    baseline, child = process_sizes
    budget = int(baseline + 2.4 * child)
    proc = fresh_server(store, *PROCESS, "--memory-budget", str(budget)).start()
    outcomes: list[tuple[int, int, int]] = []

    async def client_loop(http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}
        for i in rng.choices(range(3), [1.0, 0.47, 0.3], k=6):
            response = await http.post(f"{proc.url}/v2/models/m{i}/infer", json=body)
            got = int(response.json()["outputs"][0]["data"][0]) if response.is_success else -1
            outcomes.append((i, response.status_code, got))

    async def traffic() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(client_loop(http, random.Random(s)) for s in range(8)))

    try:
        asyncio.run(traffic())
        with httpx.Client(timeout=10) as client:
            evictions = metric(client, proc, "scriptserve_model_evictions_total")
            assert client.get(f"{proc.url}/v2/health/ready").status_code == 200
    finally:
        proc.stop()
    failed = [o for o in outcomes if o[1] != 200 or o[0] != o[2]]
    assert not failed, failed[:5]
    assert len(outcomes) == 8 * 6 and len({o[0] for o in outcomes}) == 3
    assert evictions >= 1
