"""The management API on its own port: register, versions and the default, scale, describe, list,
unregister, and what a server without --enable-model-api refuses."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from serving import ServerProcess
from testmodels import TinyMLP, reference_output, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

# Slow: servers started for a few tests each.
pytestmark = pytest.mark.slow

X = np.linspace(-1, 1, 8, dtype=np.float32)


class Doubled(TinyMLP):
    """Version 2.0 of `tiny`: the same weights, twice the output, so answers tell them apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * 2


@pytest.fixture(scope="module")
def tiny_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An archive of model `tiny` version 2.0, outside the model store."""
    work = tmp_path_factory.mktemp("tiny_v2")
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    model = save_torchscript(work / "doubled.pt", Doubled())
    argv = [
        "--model-name", "tiny", "--version", "2.0", "--serialized-file", str(model),
        "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(work / "out"),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return work / "out" / "tiny.mar"


def predict(server: ServerProcess, route: str) -> np.ndarray:
    r = httpx.post(f"{server.url}/predictions/{route}", json=X.tolist())
    assert r.status_code == 200, r.text
    return np.asarray(r.json())


def describe(server: ServerProcess, route: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.mgmt}/models/{route}", headers=server.mgmt_headers)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    doc = r.json()
    assert (doc["code"], set(doc)) == (status, {"code", "type", "message"})
    for word in words:
        assert word in doc["message"]
    assert "Traceback" not in r.text and "/tmp/" not in r.text


EXPECTED = reference_output(X[None])[0]


def test_two_versions_coexist_and_the_default_switches(
    server: ServerProcess, tiny_v2: Path
) -> None:
    shutil.copy(tiny_v2, server.store / "tiny_v2.mar")
    params = {
        "url": "tiny_v2.mar", "batch_size": 4, "max_batch_delay": 5, "initial_workers": 1,
        "synchronous": "true",
    }  # fmt: skip
    r = httpx.post(f"{server.mgmt}/models", headers=server.mgmt_headers, params=params, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": 'Model "tiny" Version: 2.0 registered with 1 initial workers'}

    both = {d["modelVersion"]: d for d in describe(server, "tiny/all")}
    assert set(both) == {"1.0", "2.0"}
    assert (both["1.0"]["isDefault"], both["2.0"]["isDefault"]) == (True, False)
    assert (both["2.0"]["batchSize"], both["2.0"]["maxBatchDelay"]) == (4, 5.0)
    assert (both["2.0"]["minWorkers"], len(both["2.0"]["workers"])) == (1, 1)
    assert both["2.0"]["modelUrl"] == "tiny_v2.mar"
    assert [d["modelVersion"] for d in describe(server, "tiny")] == ["1.0"]
    assert describe(server, "tiny/2.0")[0]["modelVersion"] == "2.0"
    meta = httpx.get(f"{server.url}/v2/models/tiny").json()
    assert sorted(meta["versions"]) == ["1.0", "2.0"]

    np.testing.assert_allclose(predict(server, "tiny"), EXPECTED, atol=1e-5)
    np.testing.assert_allclose(predict(server, "tiny/1.0"), EXPECTED, atol=1e-5)
    np.testing.assert_allclose(predict(server, "tiny/2.0"), 2 * EXPECTED, atol=1e-5)

    r = httpx.put(f"{server.mgmt}/models/tiny/2.0/set-default", headers=server.mgmt_headers)
    assert r.status_code == 200, r.text
    assert "2.0" in r.json()["status"]
    np.testing.assert_allclose(predict(server, "tiny"), 2 * EXPECTED, atol=1e-5)
    oip = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": X.tolist()}]}
    r = httpx.post(f"{server.url}/v2/models/tiny/infer", json=oip)
    assert r.json()["model_version"] == "2.0"
    assert [d["modelVersion"] for d in describe(server, "tiny")] == ["2.0"]

    # The default version cannot go while another remains.
    assert_error(
        httpx.delete(f"{server.mgmt}/models/tiny/2.0", headers=server.mgmt_headers), 409, "default"
    )
    assert_error(
        httpx.put(f"{server.mgmt}/models/tiny/9.9/set-default", headers=server.mgmt_headers),
        404,
        "'9.9'",
    )

    assert (
        httpx.put(
            f"{server.mgmt}/models/tiny/1.0/set-default", headers=server.mgmt_headers
        ).status_code
        == 200
    )
    r = httpx.delete(f"{server.mgmt}/models/tiny/2.0", headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": 'Model "tiny" version 2.0 unregistered'}
    assert [d["modelVersion"] for d in describe(server, "tiny/all")] == ["1.0"]
    assert_error(httpx.post(f"{server.url}/predictions/tiny/2.0", json=X.tolist()), 404, "2.0")
    np.testing.assert_allclose(predict(server, "tiny"), EXPECTED, atol=1e-5)


def test_asynchronous_registration(server: ServerProcess) -> None:
    shutil.copy(server.store / "tiny.mar", server.store / "tiny_copy.mar")
    params = {"url": "tiny_copy.mar", "model_name": "tiny_async", "synchronous": "false"}
    r = httpx.post(f"{server.mgmt}/models", headers=server.mgmt_headers, params=params)
    assert r.status_code == 202, r.text
    assert r.json() == {"status": "Processing worker updates..."}
    server.wait(lambda c: c.get(f"{server.url}/v2/models/tiny_async/ready").status_code == 200, 30)
    np.testing.assert_allclose(predict(server, "tiny_async"), EXPECTED, atol=1e-5)
    (desc,) = describe(server, "tiny_async")
    assert (desc["modelName"], desc["modelUrl"], desc["state"]) == (
        "tiny_async",
        "tiny_copy.mar",
        "READY",
    )
    assert desc["loadedAtStartup"] is False
    r = httpx.delete(f"{server.mgmt}/models/tiny_async", headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    assert_error(
        httpx.get(f"{server.mgmt}/models/tiny_async", headers=server.mgmt_headers),
        404,
        "'tiny_async'",
    )


def test_register_errors(server: ServerProcess) -> None:
    register = f"{server.mgmt}/models"
    assert_error(
        httpx.post(register, headers=server.mgmt_headers, params={"url": "tiny.mar"}),
        409,
        "'tiny'",
        "'1.0'",
    )
    assert_error(
        httpx.post(register, headers=server.mgmt_headers, params={"url": "nope.mar"}),
        404,
        "'nope.mar'",
    )
    for url in ("../x.mar", "/etc/passwd", "sub/tiny.mar", "..", ""):
        assert_error(
            httpx.post(register, headers=server.mgmt_headers, params={"url": url}),
            400,
            "model store",
        )
    r = httpx.post(
        register,
        headers=server.mgmt_headers,
        params={"url": "tiny.mar", "model_name": "t2", "batch_size": 0},
    )
    assert_error(r, 400, "batch_size")
    r = httpx.post(
        register, headers=server.mgmt_headers, params={"url": "tiny.mar", "model_name": "bad name"}
    )
    assert_error(r, 400, "'bad name'")
    assert_error(httpx.post(register, headers=server.mgmt_headers), 400, "url")
    # None of these left a model behind.
    names = [
        m["modelName"] for m in httpx.get(register, headers=server.mgmt_headers).json()["models"]
    ]
    assert names == ["tiny", "tiny_onnx"]


def test_a_failed_registration_leaves_nothing_behind(server: ServerProcess) -> None:
    (server.store / "broken.mar").write_bytes(b"not an archive")
    r = httpx.post(
        f"{server.mgmt}/models", headers=server.mgmt_headers, params={"url": "broken.mar"}
    )
    # The archive is the client's mistake: 400 with the reason, not a retryable 503.
    assert_error(r, 400, "'broken'", "not a model archive")
    # One bad upload must not take the replica out of service, nor linger in the model list.
    assert httpx.get(f"{server.url}/ping").json() == {"status": "Healthy"}
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    assert_error(
        httpx.get(f"{server.mgmt}/models/broken", headers=server.mgmt_headers), 404, "'broken'"
    )
    names = [
        m["modelName"]
        for m in httpx.get(f"{server.mgmt}/models", headers=server.mgmt_headers).json()["models"]
    ]
    assert names == ["tiny", "tiny_onnx"]


def test_unknown_model(server: ServerProcess) -> None:
    m = server.mgmt
    assert_error(httpx.get(f"{m}/models/nope", headers=server.mgmt_headers), 404, "'nope'")
    assert_error(httpx.get(f"{m}/models/nope/all", headers=server.mgmt_headers), 404, "'nope'")
    assert_error(httpx.get(f"{m}/models/tiny/9.9", headers=server.mgmt_headers), 404, "'9.9'")
    assert_error(
        httpx.put(f"{m}/models/nope", headers=server.mgmt_headers, params={"min_worker": 1}),
        404,
        "'nope'",
    )
    assert_error(
        httpx.put(f"{m}/models/nope/1.0/set-default", headers=server.mgmt_headers), 404, "'nope'"
    )
    assert_error(httpx.delete(f"{m}/models/nope", headers=server.mgmt_headers), 404, "'nope'")
    assert_error(httpx.delete(f"{m}/models/tiny/9.9", headers=server.mgmt_headers), 404, "'9.9'")


def test_scale_up_and_down(server: ServerProcess) -> None:
    url = f"{server.mgmt}/models/tiny_onnx"
    try:
        r = httpx.put(
            url,
            headers=server.mgmt_headers,
            params={"min_worker": 3, "synchronous": "true"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert "3" in r.json()["status"]
        (desc,) = describe(server, "tiny_onnx")
        assert (desc["minWorkers"], desc["maxWorkers"], len(desc["workers"])) == (3, 3, 3)
        assert {w["status"] for w in desc["workers"]} <= {"READY", "BUSY"}
        assert len({w["id"] for w in desc["workers"]}) == 3
        np.testing.assert_allclose(predict(server, "tiny_onnx"), EXPECTED, atol=1e-5)

        r = httpx.put(
            url + "/1.0",
            headers=server.mgmt_headers,
            params={"min_worker": 1, "synchronous": "true"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        (desc,) = describe(server, "tiny_onnx")
        assert (desc["minWorkers"], len(desc["workers"])) == (1, 1)
        np.testing.assert_allclose(predict(server, "tiny_onnx"), EXPECTED, atol=1e-5)

        # Asynchronous scaling answers 202 and gets there.
        r = httpx.put(url, headers=server.mgmt_headers, params={"min_worker": 2})
        assert r.status_code == 202, r.text
        server.wait(
            lambda c: len(c.get(url, headers=server.mgmt_headers).json()[0]["workers"]) == 2, 30
        )
    finally:
        httpx.put(
            url,
            headers=server.mgmt_headers,
            params={"min_worker": 2, "synchronous": "true"},
            timeout=60,
        )
    assert_error(
        httpx.put(url, headers=server.mgmt_headers, params={"min_worker": -1}), 400, "min_worker"
    )


def test_describe(server: ServerProcess) -> None:
    (desc,) = describe(server, "tiny")
    assert (desc["modelName"], desc["modelVersion"], desc["modelUrl"]) == (
        "tiny",
        "1.0",
        "tiny.mar",
    )
    assert (desc["modelFormat"], desc["state"], desc["isDefault"]) == ("torchscript", "READY", True)
    assert (desc["batchSize"], desc["maxBatchDelay"], desc["loadedAtStartup"]) == (32, 0.0, True)
    assert desc["jobQueueStatus"] == {
        "remainingCapacity": 1000,
        "pendingRequests": 0,
        "inFlightRequests": 0,
    }
    assert len(desc["workers"]) == 2
    for worker in desc["workers"]:
        assert worker["status"] in {"READY", "BUSY"}
        assert worker["id"].startswith("tiny-") and worker["startTime"].endswith("Z")
    assert describe(server, "tiny/1.0") == describe(server, "tiny")


def test_list_with_pagination(server: ServerProcess) -> None:
    url = f"{server.mgmt}/models"
    first = httpx.get(url, headers=server.mgmt_headers, params={"limit": 1}).json()
    assert first["models"] == [{"modelName": "tiny", "modelUrl": "tiny.mar"}]
    assert first["nextPageToken"] == "1"
    second = httpx.get(
        url,
        headers=server.mgmt_headers,
        params={"limit": 1, "next_page_token": first["nextPageToken"]},
    ).json()
    assert second == {"models": [{"modelName": "tiny_onnx", "modelUrl": "tiny_onnx.mar"}]}
    everything = httpx.get(url, headers=server.mgmt_headers).json()
    assert everything == {"models": first["models"] + second["models"]}
    for limit in (0, 1001, -1):
        assert_error(
            httpx.get(url, headers=server.mgmt_headers, params={"limit": limit}), 400, "limit"
        )
    assert_error(
        httpx.get(url, headers=server.mgmt_headers, params={"next_page_token": "x"}),
        400,
        "next_page_token",
    )


def test_openapi(server: ServerProcess) -> None:
    paths = httpx.get(f"{server.mgmt}/openapi.json", headers=server.mgmt_headers).json()["paths"]
    assert {"/models", "/models/{model_name}", "/models/{model_name}/{version}/set-default"} <= set(
        paths
    )
    assert {"get", "post"} <= set(paths["/models"])


# -- a server without --enable-model-api ----------------------------------------------------------
@pytest.fixture(scope="module")
def locked_server(model_store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(model_store, "--models", "tiny.mar", "--workers", "1").start()
    yield proc
    proc.stop()


def test_model_api_disabled(locked_server: ServerProcess) -> None:
    m = locked_server.mgmt
    r = httpx.post(
        f"{m}/models", headers=locked_server.mgmt_headers, params={"url": "tiny_onnx.mar"}
    )
    assert_error(r, 405, "--enable-model-api")
    assert_error(
        httpx.delete(f"{m}/models/tiny/1.0", headers=locked_server.mgmt_headers),
        405,
        "--enable-model-api",
    )
    assert_error(
        httpx.delete(f"{m}/models/tiny", headers=locked_server.mgmt_headers),
        405,
        "--enable-model-api",
    )
    # Reading and scaling stay available, and the model is still served.
    assert [d["modelName"] for d in describe(locked_server, "tiny")] == ["tiny"]
    assert httpx.get(f"{m}/models", headers=locked_server.mgmt_headers).json()["models"] == [
        {"modelName": "tiny", "modelUrl": "tiny.mar"}
    ]
    np.testing.assert_allclose(predict(locked_server, "tiny"), EXPECTED, atol=1e-5)
