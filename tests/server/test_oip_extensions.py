"""Triton's model configuration, statistics and model repository extensions, driven with
tritonclient over HTTP and gRPC against one real server: both transports answer the same, the
statistics agree with the Prometheus metrics, the repository calls take the management key, and
every /v2 error (unknown routes and methods included) answers `{"error": ...}`."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import reference_output
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

MAX_BATCH = 8
DELAY_MS = 2
EXTENSIONS = {"binary_tensor_data", "model_configuration", "statistics", "model_repository"}
X = (np.arange(24, dtype=np.float32).reshape(3, 8) - 12) / 10


@pytest.fixture(scope="module")
def server(model_store: Path) -> Iterator[ServerProcess]:
    """`tiny` and `tiny_onnx` loaded; `spare` (tiny's archive under another name) only in the
    store, for the repository's load and unload."""
    shutil.copy(model_store / "tiny.mar", model_store / "spare.mar")
    proc = ServerProcess(
        model_store,
        "--enable-model-api",
        "--workers",
        "1",
        "--models",
        "tiny.mar",
        "tiny_onnx.mar",
        "--max-batch-size",
        str(MAX_BATCH),
        "--max-batch-delay",
        str(DELAY_MS),
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http_client(server: ServerProcess) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(server: ServerProcess) -> Iterator[triton_grpc.InferenceServerClient]:
    client = triton_grpc.InferenceServerClient(server.grpc)
    yield client
    client.close()


def grpc_key(server: ServerProcess) -> dict[str, str]:
    return {"authorization": f"Bearer {server.management_key}"}


def infer_http(client: triton_http.InferenceServerClient, model: str, x: np.ndarray) -> None:
    tensor = triton_http.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    result = client.infer(model, [tensor])
    output = result.get_response()["outputs"][0]["name"]
    np.testing.assert_allclose(result.as_numpy(output), reference_output(x), atol=1e-5)


def infer_grpc(client: triton_grpc.InferenceServerClient, model: str, x: np.ndarray) -> None:
    tensor = triton_grpc.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor])
    output = result.get_response().outputs[0].name
    np.testing.assert_allclose(result.as_numpy(output), reference_output(x), atol=1e-5)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(server: ServerProcess) -> Samples:
    text = httpx.get(f"{server.metrics_url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(found: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and wanted <= ls)


# -- server metadata -----------------------------------------------------------------------------
def test_extensions_are_exactly_what_is_served(
    http_client: triton_http.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    assert set(http_client.get_server_metadata()["extensions"]) == EXTENSIONS
    assert set(grpc_client.get_server_metadata().extensions) == EXTENSIONS


# -- model configuration -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "platform", "backend", "output"),
    [
        ("tiny", "pytorch_torchscript", "pytorch", "output0"),
        ("tiny_onnx", "onnxruntime_onnx", "onnxruntime", "y"),
    ],
)
def test_model_config_over_http(
    http_client: triton_http.InferenceServerClient,
    model: str,
    platform: str,
    backend: str,
    output: str,
) -> None:
    config = http_client.get_model_config(model)
    assert http_client.get_model_config(model, "1.0") == config
    assert (config["name"], config["platform"], config["backend"]) == (model, platform, backend)
    # The metadata's shapes are [-1, 8] and [-1, 3]: the batch dimension is not in the dims.
    assert config["max_batch_size"] == MAX_BATCH
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("x", "TYPE_FP32", [8])
    ]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        (output, "TYPE_FP32", [3])
    ]
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == DELAY_MS * 1000
    assert batching["preferred_batch_size"] == []
    assert batching["default_queue_policy"]["max_queue_size"] == 1000
    assert config["instance_group"] == [
        {"name": f"{model}_0", "kind": "KIND_CPU", "count": 1, "gpus": []}
    ]
    assert config["model_transaction_policy"] == {"decoupled": False}
    assert config["parameters"]["quantization"] == {"string_value": "none"}


def test_model_config_over_grpc_is_the_same_message(
    server: ServerProcess, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    for model in ("tiny", "tiny_onnx"):
        rest = httpx.get(f"{server.url}/v2/models/{model}/versions/1.0/config").json()
        expected = json_format.ParseDict(rest, model_config_pb2.ModelConfig())
        assert grpc_client.get_model_config(model).config == expected
        assert grpc_client.get_model_config(model, "1.0").config == expected
        assert expected.dynamic_batching.max_queue_delay_microseconds == DELAY_MS * 1000
        assert expected.input[0].data_type == model_config_pb2.TYPE_FP32
        assert expected.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU


def test_model_config_errors(
    server: ServerProcess,
    http_client: triton_http.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    r = httpx.get(f"{server.url}/v2/models/nope/config")
    assert (r.status_code, r.json()) == (404, {"error": "model 'nope' is not registered"})
    r = httpx.get(f"{server.url}/v2/models/tiny/versions/9/config")
    assert r.status_code == 404 and "has no version '9'" in r.json()["error"]
    with pytest.raises(InferenceServerException, match="model 'nope' is not registered"):
        http_client.get_model_config("nope")
    with pytest.raises(InferenceServerException) as caught:
        grpc_client.get_model_config("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert "model 'nope' is not registered" in caught.value.message()


# -- statistics ----------------------------------------------------------------------------------
def by_model(stats: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{s['name']}/{s['version']}": s for s in stats}


def test_statistics_count_requests_rows_and_times(
    server: ServerProcess, http_client: triton_http.InferenceServerClient
) -> None:
    (before,) = http_client.get_inference_statistics("tiny_onnx")["model_stats"]
    started_ms = time.time() * 1000
    for rows in (1, 3):
        infer_http(http_client, "tiny_onnx", X[:rows])
    bad = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [1.0]}]}
    assert httpx.post(f"{server.url}/v2/models/tiny_onnx/infer", json=bad).status_code == 400
    (after,) = http_client.get_inference_statistics("tiny_onnx", "1.0")["model_stats"]

    assert (after["name"], after["version"]) == ("tiny_onnx", "1.0")
    stats, was = after["inference_stats"], before["inference_stats"]

    def delta(key: str) -> tuple[int, int]:
        return stats[key]["count"] - was[key]["count"], stats[key]["ns"] - was[key]["ns"]

    assert delta("success")[0] == 2 and delta("success")[1] > 0
    assert delta("fail")[0] == 1  # refused before it was queued: no queue or compute time
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        count, ns = delta(key)
        assert count == 2 and ns > 0, key
    assert delta("cache_hit") == delta("cache_miss") == (0, 0)
    assert after["inference_count"] - before["inference_count"] == 4  # rows
    assert after["execution_count"] - before["execution_count"] == 2
    sizes = {b["batch_size"]: b for b in after["batch_stats"]}
    assert {1, 3} <= set(sizes)
    assert sizes[3]["compute_infer"]["count"] >= 1 and sizes[3]["compute_infer"]["ns"] > 0
    assert started_ms - 1000 <= after["last_inference"] <= time.time() * 1000 + 1000
    # A request's time covers its queue and compute time.
    assert delta("success")[1] >= delta("queue")[1] + delta("compute_infer")[1]


def test_statistics_are_the_prometheus_measurements(
    server: ServerProcess, http_client: triton_http.InferenceServerClient
) -> None:
    for _ in range(3):
        infer_http(http_client, "tiny", X)
    (stats,) = http_client.get_inference_statistics("tiny")["model_stats"]
    found = samples(server)
    labels = {"model": "tiny", "version": "1.0"}
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == sample(
        found, "scriptserve_requests_total", status="200", **labels
    )
    assert inference["queue"]["count"] == sample(
        found, "scriptserve_queue_latency_seconds_count", **labels
    )
    queue_s = sample(found, "scriptserve_queue_latency_seconds_sum", **labels)
    assert inference["queue"]["ns"] / 1e9 == pytest.approx(queue_s, abs=1e-6)
    batches = sum(b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert batches == stats["execution_count"]
    for stage in ("input", "infer", "output"):
        key = f"compute_{stage}"
        assert batches == sample(found, "scriptserve_compute_seconds_count", stage=stage, **labels)
        seconds = sample(found, "scriptserve_compute_seconds_sum", stage=stage, **labels)
        per_batch_ns = sum(b[key]["ns"] for b in stats["batch_stats"])
        assert per_batch_ns / 1e9 == pytest.approx(seconds, abs=1e-6)
    # The three stages are the handler time of the batches.
    handler_s = sample(found, "scriptserve_inference_latency_seconds_sum", **labels)
    stages_s = sum(
        sample(found, "scriptserve_compute_seconds_sum", stage=stage, **labels)
        for stage in ("input", "infer", "output")
    )
    assert stages_s == pytest.approx(handler_s, rel=1e-3, abs=1e-6)


def test_statistics_of_every_model_and_over_grpc(
    server: ServerProcess,
    http_client: triton_http.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    infer_grpc(grpc_client, "tiny", X)
    everything = http_client.get_inference_statistics()["model_stats"]
    assert [(s["name"], s["version"]) for s in everything] == [
        ("tiny", "1.0"),
        ("tiny_onnx", "1.0"),
    ]
    assert httpx.get(f"{server.url}/v2/models/stats").json()["model_stats"] == everything
    over_grpc = grpc_client.get_inference_statistics()
    # tritonclient 2.41's messages predate `response_stats` (empty here: nothing streams).
    expected = json_format.ParseDict(
        {"model_stats": everything},
        service_pb2.ModelStatisticsResponse(),
        ignore_unknown_fields=True,
    )
    assert over_grpc == expected
    one = grpc_client.get_inference_statistics("tiny", "1.0")
    assert [(s.name, s.version) for s in one.model_stats] == [("tiny", "1.0")]
    assert one.model_stats[0].inference_stats.success.count >= 1
    assert grpc_client.get_inference_statistics("tiny").model_stats == one.model_stats
    with pytest.raises(InferenceServerException, match="model 'nope' is not registered"):
        grpc_client.get_inference_statistics("nope")
    r = httpx.get(f"{server.url}/v2/models/tiny/versions/9/stats")
    assert r.status_code == 404 and "has no version '9'" in r.json()["error"]


# -- model repository ----------------------------------------------------------------------------
def index_of(entries: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e.get("state", ""), e.get("reason", "")) for e in entries}


def test_repository_over_http(
    server: ServerProcess, http_client: triton_http.InferenceServerClient
) -> None:
    key = server.mgmt_headers
    index = index_of(http_client.get_model_repository_index(headers=key))
    assert index == {
        "spare": ("UNAVAILABLE", "not loaded"),
        "tiny": ("READY", ""),
        "tiny_onnx": ("READY", ""),
    }
    http_client.load_model("spare", headers=key)
    assert http_client.is_model_ready("spare")
    infer_http(http_client, "spare", X)
    ready = http_client.get_model_repository_index(headers=key)
    assert {"name": "spare", "version": "1.0", "state": "READY"} in ready
    http_client.load_model("spare", headers=key)  # loaded already: it stays as it is
    assert http_client.is_model_ready("spare")
    http_client.unload_model("spare", headers=key)
    assert not http_client.is_model_ready("spare")
    assert (
        index_of(http_client.get_model_repository_index(headers=key))["spare"][0] == "UNAVAILABLE"
    )
    r = httpx.post(f"{server.url}/v2/repository/index", json={"ready": True}, headers=key)
    assert [e["name"] for e in r.json()] == ["tiny", "tiny_onnx"]


def test_repository_errors_over_http(
    server: ServerProcess, http_client: triton_http.InferenceServerClient
) -> None:
    key = server.mgmt_headers
    with pytest.raises(InferenceServerException, match="has no archive for model 'nope'"):
        http_client.load_model("nope", headers=key)
    with pytest.raises(InferenceServerException, match="parameter 'config' is not supported"):
        http_client.load_model("spare", config='{"max_batch_size": 4}', headers=key)
    with pytest.raises(InferenceServerException, match="model 'nope' is not loaded"):
        http_client.unload_model("nope", headers=key)
    url = f"{server.url}/v2/repository"
    r = httpx.post(f"{url}/index", content=b"[1", headers=key)
    assert (r.status_code, r.json()) == (
        400,
        {"error": "the request body must be a JSON object (or empty)"},
    )
    r = httpx.post(f"{url}/index", json={"ready": "yes"}, headers=key)
    assert (r.status_code, r.json()) == (400, {"error": "'ready' must be true or false"})
    r = httpx.post(f"{url}/models/spare/load", json={"parameters": {"x": 1}}, headers=key)
    assert r.status_code == 400 and "unknown parameter 'x'" in r.json()["error"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/repository/models/spare/load"),
        ("POST", "/v2/repository/models/tiny/unload"),
    ],
)
def test_repository_takes_the_management_key(server: ServerProcess, method: str, path: str) -> None:
    r = httpx.request(method, f"{server.url}{path}")
    assert r.status_code == 401 and "needs a key" in r.json()["error"]
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.request(method, f"{server.url}{path}", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    # The rest of the inference API still needs no key (none is configured).
    assert httpx.get(f"{server.url}/v2/models/tiny/config").status_code == 200
    assert httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 200


def test_repository_over_grpc(
    server: ServerProcess,
    http_client: triton_http.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    key = grpc_key(server)
    index = grpc_client.get_model_repository_index(headers=key)
    assert [(m.name, m.state, m.reason) for m in index.models] == [
        ("spare", "UNAVAILABLE", "not loaded"),
        ("tiny", "READY", ""),
        ("tiny_onnx", "READY", ""),
    ]
    rest = http_client.get_model_repository_index(headers=server.mgmt_headers)
    expected = json_format.ParseDict({"models": rest}, service_pb2.RepositoryIndexResponse())
    assert index == expected
    grpc_client.load_model("spare", headers=key)
    assert grpc_client.is_model_ready("spare")
    infer_grpc(grpc_client, "spare", X)
    grpc_client.unload_model("spare", headers=key)
    assert not http_client.is_model_ready("spare")
    with pytest.raises(InferenceServerException) as caught:
        grpc_client.load_model("nope", headers=key)
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert "has no archive for model 'nope'" in caught.value.message()


@pytest.mark.parametrize("call", ["get_model_repository_index", "load_model", "unload_model"])
def test_grpc_repository_takes_the_management_key(
    server: ServerProcess, grpc_client: triton_grpc.InferenceServerClient, call: str
) -> None:
    args = () if call == "get_model_repository_index" else ("spare",)
    with pytest.raises(InferenceServerException) as caught:
        getattr(grpc_client, call)(*args)
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as caught:
        getattr(grpc_client, call)(*args, headers={"authorization": "Bearer wrong"})
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"


def test_grpc_methods_are_the_protos(server: ServerProcess) -> None:
    """Each extension method answers on Triton's full method name."""
    with grpc.insecure_channel(server.grpc) as channel:
        config = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelConfig",
            request_serializer=service_pb2.ModelConfigRequest.SerializeToString,
            response_deserializer=service_pb2.ModelConfigResponse.FromString,
        )(service_pb2.ModelConfigRequest(name="tiny"))
    assert config.config.max_batch_size == MAX_BATCH
    assert list(config.config.input[0].dims) == [8]


# -- /v2 errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/v2/nope", 404, "not found: no route matches this path"),
        ("POST", "/v2/models/tiny/nope", 404, "not found: no route matches this path"),
        ("GET", "/v2/models/tiny/infer", 405, "method GET is not allowed on this route; use POST"),
        ("DELETE", "/v2/models/tiny", 405, "method DELETE is not allowed on this route; use GET"),
        ("PUT", "/v2/repository/index", 405, "method PUT is not allowed on this route; use POST"),
        ("POST", "/v2/models/stats", 405, "method POST is not allowed on this route; use GET"),
    ],
)
def test_every_v2_error_is_the_protocols(
    server: ServerProcess, method: str, path: str, status: int, message: str
) -> None:
    r = httpx.request(method, f"{server.url}{path}", headers=server.mgmt_headers)
    assert (r.status_code, r.json()) == (status, {"error": message})
    assert r.headers["content-type"] == "application/json"
    if status == 405:
        assert r.headers["allow"]


def test_other_unknown_routes_keep_torchserves_shape(server: ServerProcess) -> None:
    for url, headers in ((server.url, {}), (server.mgmt, server.mgmt_headers)):
        r = httpx.get(f"{url}/nope", headers=headers)
        assert (r.status_code, r.json()) == (
            404,
            {
                "code": 404,
                "type": "RouteNotFound",
                "message": "not found: no route matches this path",
            },
        )


@pytest.mark.slow
def test_statistics_of_process_workers(
    server: ServerProcess, http_client: triton_http.InferenceServerClient
) -> None:
    """A process worker's stages come back from its process with its answers."""
    params = {"url": "spare.mar", "model_name": "proc", "worker_mode": "process"}
    # Registering starts the server's fork server (it imports torch) and a worker forked from
    # it: seconds on a loaded 2-core machine, past httpx's 5 s default.
    r = httpx.post(f"{server.mgmt}/models", params=params, headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    try:
        for rows in (1, 2):
            infer_http(http_client, "proc", X[:rows])
        (stats,) = http_client.get_inference_statistics("proc")["model_stats"]
        inference = stats["inference_stats"]
        for key in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert inference[key]["count"] == 2 and inference[key]["ns"] > 0, key
        assert (stats["inference_count"], stats["execution_count"]) == (3, 2)
        config = http_client.get_model_config("proc")
        assert config["parameters"]["worker_mode"] == {"string_value": "process"}
    finally:
        httpx.delete(f"{server.mgmt}/models/proc", headers=server.mgmt_headers, timeout=60)
