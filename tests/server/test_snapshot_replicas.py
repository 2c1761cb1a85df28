"""Replicas sharing one model store and snapshot folder: each restores only its own snapshot,
no reader ever sees a torn file, the declarative mode records nothing, and the legacy
`models.json` is taken over by exactly one replica."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serving import ServerProcess

from scriptserve.server.cli import build_parser, settings_from_args
from scriptserve.server.settings import SettingsError, load_settings

# Slow: replicas started and restarted for each test.
pytestmark = pytest.mark.slow

REGISTER_TIMEOUT_S = 60.0


def replica(
    store: Path, snapshots: Path, *args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    return ServerProcess(
        store,
        "--enable-model-api",
        "--workers",
        "1",
        "--no-warmup",
        "--snapshot-dir",
        str(snapshots),
        *args,
        env=env,
    )


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    """Servers a test starts with `start_all`; all stopped at its end, whatever happened."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.stop()


def start_all(started: list[ServerProcess], *replicas: ServerProcess) -> None:
    """Start the replicas at the same time (they share the folders, as pods do)."""
    started.extend(replicas)
    with ThreadPoolExecutor(len(replicas)) as pool:
        list(pool.map(lambda s: s.start(), replicas))


def stop_all(*replicas: ServerProcess) -> None:
    for server in replicas:
        assert server.terminate() == 0, server.output()


def register(server: ServerProcess, name: str, archive: str) -> None:
    params = {"url": archive, "model_name": name, "initial_workers": 1, "synchronous": "true"}
    r = httpx.post(
        f"{server.mgmt}/models",
        params=params,
        headers=server.mgmt_headers,
        timeout=REGISTER_TIMEOUT_S,
    )
    assert r.status_code == 200, r.text


def unregister(server: ServerProcess, name: str) -> None:
    r = httpx.delete(
        f"{server.mgmt}/models/{name}", headers=server.mgmt_headers, timeout=REGISTER_TIMEOUT_S
    )
    assert r.status_code == 200, r.text


def served(server: ServerProcess) -> set[str]:
    r = httpx.get(f"{server.mgmt}/models", headers=server.mgmt_headers)
    assert r.status_code == 200, r.text
    return {m["modelName"] for m in r.json()["models"]}


def recorded(snapshot: Path) -> set[str]:
    return {m["name"] for m in json.loads(snapshot.read_text())["models"]}


def test_each_replica_restores_its_own_registrations_and_not_the_others(
    model_store: Path, tmp_path: Path, servers: list[ServerProcess]
) -> None:
    snapshots = tmp_path / "snapshots"

    def replicas() -> tuple[ServerProcess, ServerProcess]:
        # One id from the flag, one from the environment: both are how a pod would say it.
        a = replica(model_store, snapshots, "--snapshot-id", "replica-a")
        b = replica(model_store, snapshots, env={"SCRIPTSERVE_SNAPSHOT_ID": "replica-b"})
        return a, b

    a, b = replicas()
    start_all(servers, a, b)
    assert served(a) == served(b) == {"tiny", "tiny_onnx"}  # no snapshot yet: the whole store
    register(a, "alpha", "tiny.mar")
    unregister(a, "tiny_onnx")
    register(b, "beta", "tiny_onnx.mar")
    stop_all(a, b)
    assert sorted(p.name for p in snapshots.iterdir()) == [
        "models-replica-a.json",
        "models-replica-b.json",
    ]

    a, b = replicas()
    start_all(servers, a, b)
    assert served(a) == {"tiny", "alpha"}
    assert served(b) == {"tiny", "tiny_onnx", "beta"}
    r = httpx.post(f"{a.url}/predictions/alpha", json=[0.5] * 8)
    assert r.status_code == 200, r.text
    assert "models-replica-a.json" in a.output()


def test_concurrent_changes_on_two_replicas_never_show_a_torn_snapshot(
    model_store: Path, tmp_path: Path, servers: list[ServerProcess]
) -> None:
    snapshots = tmp_path / "snapshots"
    a = replica(model_store, snapshots, "--snapshot-id", "a", "--models", "tiny.mar")
    b = replica(model_store, snapshots, "--snapshot-id", "b", "--models", "tiny.mar")
    start_all(servers, a, b)

    done = threading.Event()
    parsed: dict[str, int] = {}
    torn: list[tuple[str, str]] = []

    def read_every_snapshot() -> None:
        while not done.is_set():
            for path in snapshots.glob("*.json"):
                text = path.read_text()
                try:
                    json.loads(text)["models"]
                except (ValueError, KeyError):
                    torn.append((path.name, text))
                    continue
                parsed[path.name] = parsed.get(path.name, 0) + 1

    def churn(server: ServerProcess, prefix: str) -> None:
        for i in range(6):
            register(server, f"{prefix}-{i}", "tiny.mar")
            unregister(server, f"{prefix}-{i}")

    reader = threading.Thread(target=read_every_snapshot)
    reader.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            for work in [pool.submit(churn, a, "a"), pool.submit(churn, b, "b")]:
                work.result()
    finally:
        done.set()
        reader.join()

    assert not torn, torn[0]
    assert set(parsed) == {"models-a.json", "models-b.json"}
    assert min(parsed.values()) > 10
    # Only the two snapshots remain: no temporary file is left behind.
    assert sorted(p.name for p in snapshots.iterdir()) == ["models-a.json", "models-b.json"]
    assert (
        recorded(snapshots / "models-a.json") == recorded(snapshots / "models-b.json") == {"tiny"}
    )


def test_declarative_mode_records_nothing_and_restarts_from_the_config(
    model_store: Path, tmp_path: Path, servers: list[ServerProcess]
) -> None:
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    # What an earlier per-replica run (and an older version) left: ignored in this mode.
    earlier = {
        "models": [
            {
                "name": "ghost",
                "version": "1.0",
                "source": "tiny.mar",
                "default": True,
                "settings": {},
            }
        ]
    }
    for name in ("models-decl.json", "models.json"):
        (snapshots / name).write_text(json.dumps(earlier))
    before = {p.name: p.read_bytes() for p in snapshots.iterdir()}
    config = tmp_path / "serve.yaml"
    config.write_text("snapshot_mode: declarative\nmodels: [tiny.mar]\n")

    def declarative() -> ServerProcess:
        return replica(model_store, snapshots, "--config", str(config), "--snapshot-id", "decl")

    server = declarative()
    start_all(servers, server)
    assert served(server) == {"tiny"}
    register(server, "extra", "tiny_onnx.mar")
    unregister(server, "tiny")
    assert served(server) == {"extra"}
    stop_all(server)
    assert {p.name: p.read_bytes() for p in snapshots.iterdir()} == before

    server = declarative()
    start_all(servers, server)
    assert served(server) == {"tiny"}


def test_the_legacy_snapshot_is_taken_over_once_by_one_replica(
    model_store: Path, tmp_path: Path, servers: list[ServerProcess]
) -> None:
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    legacy = {
        "models": [
            {
                "name": "kept",
                "version": "1.0",
                "source": "tiny.mar",
                "default": True,
                "settings": {"batch_size": 4},
            }
        ]
    }
    (snapshots / "models.json").write_text(json.dumps(legacy))

    def replicas() -> dict[str, ServerProcess]:
        return {i: replica(model_store, snapshots, "--snapshot-id", i) for i in ("one", "two")}

    first = replicas()
    start_all(servers, *first.values())
    took = [i for i, s in first.items() if "took over the legacy model snapshot" in s.output()]
    assert len(took) == 1, [s.output() for s in first.values()]
    (winner,) = took
    (loser,) = set(first) - {winner}
    assert served(first[winner]) == {"kept"}
    assert served(first[loser]) == {"tiny", "tiny_onnx"}
    assert [p.name for p in snapshots.iterdir()] == [f"models-{winner}.json"]
    stop_all(*first.values())

    again = replicas()
    start_all(servers, *again.values())
    assert served(again[winner]) == {"kept"}  # now from its own file
    assert served(again[loser]) == {"tiny", "tiny_onnx"}
    assert not any("took over" in s.output() for s in again.values())
    r = httpx.get(f"{again[winner].mgmt}/models/kept", headers=again[winner].mgmt_headers)
    assert r.json()[0]["batchSize"] == 4


def test_snapshot_flags_and_ids_that_cannot_name_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("SCRIPTSERVE_")]:
        monkeypatch.delenv(name)
    args = ["serve", "--snapshot-mode", "declarative", "--snapshot-id", "web-0", "--no-snapshot"]
    s = settings_from_args(build_parser().parse_args(args))
    assert (s.snapshot_mode, s.snapshot_id, s.restore_snapshot) == ("declarative", "web-0", False)
    s = load_settings()
    assert (s.snapshot_mode, s.snapshot_id, s.restore_snapshot) == ("per-replica", None, True)
    for bad in ("../web-0", "a/b", ".hidden", "", "x" * 201):
        with pytest.raises(SettingsError, match=r"snapshot_id: .* must start with a letter"):
            load_settings(snapshot_id=bad)
