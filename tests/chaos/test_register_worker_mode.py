"""Choosing the worker mode at registration: REST `worker_mode=process` and gRPC RegisterModel
metadata `scriptserve-worker-mode: process` give the model process workers (children of the
server) that serve correct outputs; a mode that does not exist is refused with what to use."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
from chaos.chaoskit import build_archive, describe, infer, models_dir, output, row, worker_pids
from serving import ServerProcess
from testmodels import reference_output
from tsprotos import torchserve_stubs

# Slow: workers failing and servers draining under load.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("register_mode")
    torchscript, _ = models_dir(root)
    store = root / "store"
    build_archive(store, root / "work", "plain", torchscript, {}, chaos=False)
    proc = ServerProcess(
        store, "--models", "plain.mar", "--workers", "1", "--enable-model-api", "--no-snapshot"
    ).start()
    yield proc
    proc.stop()


def _serves_with_process_workers(server: ServerProcess, name: str) -> None:
    assert describe(server, name)["workerMode"] == "process"
    assert worker_pids(server, name)
    x = row(seed=3)
    np.testing.assert_allclose(
        output(infer(server, name, x)), reference_output(x), rtol=1e-5, atol=1e-6
    )


def _unregister(server: ServerProcess, name: str) -> None:
    r = httpx.delete(f"{server.mgmt}/models/{name}/1.0", headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text


def test_rest_registration_chooses_process_workers(server: ServerProcess) -> None:
    assert describe(server, "plain")["workerMode"] == "thread"
    params = {"url": "plain.mar", "model_name": "plain_rest", "worker_mode": "process"}
    r = httpx.post(f"{server.mgmt}/models", params=params, headers=server.mgmt_headers, timeout=120)
    assert r.status_code == 200, r.text
    try:
        _serves_with_process_workers(server, "plain_rest")
    finally:
        _unregister(server, "plain_rest")


def test_grpc_registration_chooses_process_workers(server: ServerProcess) -> None:
    metadata = (
        ("authorization", f"Bearer {server.management_key}"),
        ("scriptserve-worker-mode", "process"),
    )
    request = torchserve_stubs().mgmt.RegisterModelRequest(
        url="plain.mar", model_name="plain_grpc", initial_workers=1, synchronous=True
    )
    with grpc.insecure_channel(server.grpc_mgmt) as channel:
        stub = torchserve_stubs().mgmt_grpc.ManagementAPIsServiceStub(channel)
        stub.RegisterModel(request, metadata=metadata, timeout=120)
    try:
        _serves_with_process_workers(server, "plain_grpc")
    finally:
        _unregister(server, "plain_grpc")


def test_an_unknown_mode_is_refused(server: ServerProcess) -> None:
    params = {"url": "plain.mar", "model_name": "plain_fork", "worker_mode": "fork"}
    r = httpx.post(f"{server.mgmt}/models", params=params, headers=server.mgmt_headers)
    assert r.status_code == 400 and "worker_mode" in r.text
    metadata = (
        ("authorization", f"Bearer {server.management_key}"),
        ("scriptserve-worker-mode", "fork"),
    )
    request = torchserve_stubs().mgmt.RegisterModelRequest(
        url="plain.mar", model_name="plain_fork", synchronous=True
    )
    with grpc.insecure_channel(server.grpc_mgmt) as channel:
        stub = torchserve_stubs().mgmt_grpc.ManagementAPIsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.RegisterModel(request, metadata=metadata, timeout=60)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'thread' or 'process'" in str(exc.value.details())
    assert describe(server, "plain")["workerMode"] == "thread"
