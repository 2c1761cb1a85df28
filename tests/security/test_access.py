"""Access keys over REST and gRPC: the management key always, the inference key when set,
open probes, constant behaviour for missing/wrong/other keys, and refusing to listen beyond
loopback without a key."""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hardening import assert_no_leak
from serving import ServerProcess, free_port
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tsprotos import torchserve_stubs

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

X = np.linspace(-1, 1, 8, dtype=np.float32)
INFERENCE_KEY = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        store,
        "--enable-model-api",
        "--workers",
        "1",
        env={"SCRIPTSERVE_INFERENCE_KEY": INFERENCE_KEY},
    ).start()
    yield proc
    proc.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_management_rest_needs_its_key(server: ServerProcess) -> None:
    url = f"{server.mgmt}/models"
    for headers, status in (
        ({}, 401),
        (bearer("wrong"), 401),
        ({"Authorization": server.management_key}, 401),  # no "Bearer"
        (bearer(INFERENCE_KEY), 403),
    ):
        r = httpx.get(url, headers=headers)
        assert r.status_code == status, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        assert "key" in r.json()["message"]
        assert_no_leak(r, server.management_key, INFERENCE_KEY)
    r = httpx.get(url, headers=server.mgmt_headers)
    assert r.status_code == 200
    assert [m["modelName"] for m in r.json()["models"]] == ["tiny"]
    # Every route, unknown ones and the OpenAPI document included.
    for path in ("/models/tiny", "/openapi.json", "/nope"):
        assert httpx.get(f"{server.mgmt}{path}").status_code == 401
    r = httpx.post(f"{server.mgmt}/models", params={"url": "tiny.mar", "model_name": "t2"})
    assert r.status_code == 401


def test_inference_rest_needs_its_key_when_set(server: ServerProcess) -> None:
    for path, body in (
        ("/predictions/tiny", {"json": X.tolist()}),  # answered by the HTTP protocol
        (
            "/v2/models/tiny/infer",
            {
                "json": {
                    "inputs": [
                        {"name": "x", "shape": [1, 8], "datatype": "FP32", "data": X.tolist()}
                    ]
                }
            },
        ),
    ):
        assert httpx.post(f"{server.url}{path}", **body).status_code == 401
        r = httpx.post(f"{server.url}{path}", headers=bearer("x" * 32), **body)
        assert r.status_code == 401
        assert_no_leak(r, INFERENCE_KEY)
        r = httpx.post(f"{server.url}{path}", headers=server.mgmt_headers, **body)
        assert r.status_code == 403
        r = httpx.post(f"{server.url}{path}", headers=bearer(INFERENCE_KEY), **body)
        assert r.status_code == 200, r.text
    assert httpx.get(f"{server.url}/v2/models/tiny").status_code == 401
    assert httpx.get(f"{server.url}/v2").status_code == 401


def test_probes_need_no_key_and_say_nothing_else(server: ServerProcess) -> None:
    for path, body in (
        ("/ping", {"status": "Healthy"}),
        ("/v2/health/live", {"live": True}),
        ("/v2/health/ready", {"ready": True}),
    ):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 200
        assert r.json() == body
    with grpc.insecure_channel(server.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    # Prometheus scrapes without a key (the metrics port binds loopback by default).
    assert httpx.get(f"{server.metrics_url}/metrics").status_code == 200


def test_grpc_keys(server: ServerProcess) -> None:
    stubs = torchserve_stubs()

    with grpc.insecure_channel(server.grpc_mgmt) as channel:
        stub = stubs.mgmt_grpc.ManagementAPIsServiceStub(channel)
        request = stubs.mgmt.ListModelsRequest()
        for metadata, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", f"Bearer {INFERENCE_KEY}"),), grpc.StatusCode.PERMISSION_DENIED),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                stub.ListModels(request, timeout=10, metadata=metadata)
            assert exc.value.code() == code
            assert "key" in exc.value.details()
            assert INFERENCE_KEY not in exc.value.details()
        good = (("authorization", f"Bearer {server.management_key}"),)
        listing = json.loads(stub.ListModels(request, timeout=10, metadata=good).msg)
        assert [m["modelName"] for m in listing["models"]] == ["tiny"]
    with grpc.insecure_channel(server.grpc) as channel:
        oip = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        infer = service_pb2.ModelInferRequest(model_name="tiny")
        tensor = infer.inputs.add(name="x", datatype="FP32", shape=[1, 8])
        tensor.contents.fp32_contents.extend(X.tolist())
        with pytest.raises(grpc.RpcError) as exc:
            oip.ModelInfer(infer, timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            oip.ModelInfer(infer, timeout=10, metadata=good)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        answer = oip.ModelInfer(
            infer, timeout=10, metadata=(("authorization", f"Bearer {INFERENCE_KEY}"),)
        )
        assert answer.model_name == "tiny"


def test_keys_never_logged(server: ServerProcess) -> None:
    log = server.output()
    assert server.management_key not in log
    assert INFERENCE_KEY not in log


# -- listening beyond loopback ----------------------------------------------------------------
def serve_cmd(store: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "scriptserve",
        "serve",
        "--model-store",
        str(store),
        "--models",
        "tiny.mar",
        "--management-address",
        f"127.0.0.1:{free_port()}",
        "--metrics-address",
        f"127.0.0.1:{free_port()}",
        "--grpc-inference-address",
        f"127.0.0.1:{free_port()}",
        "--grpc-management-address",
        f"127.0.0.1:{free_port()}",
        *args,
    ]


def test_refuses_non_loopback_without_a_key(store: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("key_file: null\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCRIPTSERVE_")}
    env["SCRIPTSERVE_MANAGEMENT_KEY"] = "m" * 32
    cmd = serve_cmd(store, "--config", str(config), "--inference-address", f"0.0.0.0:{free_port()}")
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1
    assert "refusing to listen beyond loopback without an inference key" in lines[0]
    assert "--insecure-no-auth" in lines[0]


def test_generated_inference_key_beyond_loopback(store: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "keys.json"
    proc = ServerProcess(store, "--models", "tiny.mar", "--key-file", str(key_file))
    port = proc.ports[0]
    proc.args += ["--inference-address", f"0.0.0.0:{port}"]
    proc.start()
    try:
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = json.loads(key_file.read_text())["inference"]
        assert str(key_file) in proc.output()
        assert key not in proc.output()
        url = f"http://127.0.0.1:{port}/predictions/tiny"
        assert httpx.post(url, json=X.tolist()).status_code == 401
        assert httpx.post(url, json=X.tolist(), headers=bearer(key)).status_code == 200
    finally:
        proc.stop()


def test_insecure_no_auth_warns_every_start(store: Path) -> None:
    proc = ServerProcess(store, "--models", "tiny.mar", "--insecure-no-auth")
    port = proc.ports[0]
    proc.args += ["--inference-address", f"0.0.0.0:{port}"]
    proc.start()
    try:
        assert "insecure_no_auth is set" in proc.output()
        assert "0.0.0.0" in proc.output()
        r = httpx.post(f"http://127.0.0.1:{port}/predictions/tiny", json=X.tolist())
        assert r.status_code == 200
        assert httpx.get(f"{proc.mgmt}/models").status_code == 200
    finally:
        proc.stop()
