"""A TorchServe config.properties: parsed, mapped, and serving the same models, ports, batching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from serving import ServerProcess
from torchserve.tsarchives import instance
from tsprotos import torchserve_stubs

from scriptserve.server.models.torchserve_config import (
    TorchServeConfigError,
    parse_properties,
    read_torchserve_config,
)
from scriptserve.server.settings import SettingsError, load_settings


def properties(server: ServerProcess, store: Path, models: dict[str, object]) -> str:
    host = "127.0.0.1"
    return (
        "\n".join(
            [
                "# TorchServe config",
                f"inference_address=http://{host}:{server.ports[0]}",
                f"management_address=http://{host}:{server.ports[1]}",
                f"metrics_address=http://{host}:{server.ports[2]}",
                f"grpc_inference_port={server.ports[3]}",
                f"grpc_management_port={server.ports[4]}",
                f"model_store={store}",
                "load_models=scores.mar,builtin.mar",
                "models=" + json.dumps(models),
                "default_workers_per_model=1",
                "job_queue_size=50",
                "number_of_netty_threads=4",
                "metrics_mode=prometheus",
            ]
        )
        + "\n"
    )


MODELS = {
    "scores": {"1.0": {"batchSize": 4, "maxBatchDelay": 250, "minWorkers": 1, "maxWorkers": 3}},
    "builtin": {"1.0": {"batchSize": 8, "maxBatchDelay": 300, "responseTimeout": 30}},
}


@pytest.fixture(scope="module")
def ts_server(ts_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("ts_config")
    server = ServerProcess(ts_store)
    config = work / "config.properties"
    config.write_text(properties(server, ts_store, MODELS))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **server.env}
    with server.log.open("wb") as log:
        server.proc = subprocess.Popen(
            [sys.executable, "-m", "scriptserve", "serve", "--ts-config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
    server.wait(lambda c: c.get(f"{server.url}/v2/health/ready").status_code == 200, 120)
    yield server
    server.stop()


def describe(server: ServerProcess, model: str) -> dict[str, object]:
    r = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers, timeout=30)
    assert r.status_code == 200, r.text
    (desc,) = r.json()
    return desc  # type: ignore[no-any-return]


@pytest.mark.slow
def test_the_server_listens_where_config_properties_says(ts_server: ServerProcess) -> None:
    r = httpx.post(f"{ts_server.url}/predictions/builtin", json=instance(1), timeout=30)
    assert r.status_code == 200
    with grpc.insecure_channel(ts_server.grpc) as channel:
        stub = torchserve_stubs().ts_grpc.InferenceAPIsServiceStub(channel)
        reply = stub.Predictions(
            torchserve_stubs().ts.PredictionsRequest(
                model_name="scores", input={"data": json.dumps(instance(1)).encode()}
            ),
            timeout=30,
        )
    assert json.loads(reply.prediction)["max_batch"] == 8  # the archive config's batchSize
    assert httpx.get(f"{ts_server.metrics_url}/metrics", timeout=30).status_code == 200


@pytest.mark.slow
def test_models_get_the_batching_of_the_models_property(ts_server: ServerProcess) -> None:
    scores = describe(ts_server, "scores")
    # The archive's own config file (batchSize 8, delay 400, maxWorkers 2) wins, as in TorchServe.
    assert (scores["batchSize"], scores["maxBatchDelay"], scores["maxWorkers"]) == (8, 400, 2)
    builtin = describe(ts_server, "builtin")
    assert (builtin["batchSize"], builtin["maxBatchDelay"]) == (8, 300)
    assert builtin["responseTimeout"] == 30
    assert builtin["minWorkers"] == 1
    assert builtin["jobQueueStatus"]["remainingCapacity"] == 50  # type: ignore[index]


@pytest.mark.slow
def test_only_load_models_are_loaded(ts_server: ServerProcess) -> None:
    r = httpx.get(f"{ts_server.mgmt}/models", headers=ts_server.mgmt_headers, timeout=30)
    assert sorted(m["modelName"] for m in r.json()["models"]) == ["builtin", "scores"]


@pytest.mark.slow
def test_ignored_keys_are_named_on_one_log_line(ts_server: ServerProcess) -> None:
    (line,) = [ln for ln in ts_server.output().splitlines() if "ignoring" in ln]
    assert "metrics_mode, number_of_netty_threads" in line


def test_properties_syntax() -> None:
    text = "a=1\nb : two\n# comment\n! also\nc = x\\\n  y\nd=http\\://h\\:1\n"
    assert parse_properties(text) == {"a": "1", "b": "two", "c": "xy", "d": "http://h:1"}


def test_mapping_of_each_key(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text(
        "inference_address=http://0.0.0.0:9080\n"
        "grpc_inference_port=9070\n"
        "model_store=/models\n"
        "load_models=all\n"
        "default_response_timeout=60\n"
        "allowed_urls=https://s3.amazonaws.com/.*,file:///models/.*\n"
        "max_request_size=1048576\n"
        "enable_model_api=true\n"
        "disable_token_authorization=false\n"
        "vmargs=-Xmx4g\n"
    )
    config = read_torchserve_config(path)
    assert config.settings == {
        "inference_address": "0.0.0.0:9080",
        "grpc_inference_address": "127.0.0.1:9070",
        "model_store": Path("/models"),
        "models": ["all"],
        "response_timeout_s": 60,
        "allowed_urls": ["https://s3.amazonaws.com/.*", "file:///models/.*"],
        "max_request_bytes": 1048576,
        "enable_model_api": True,
        "insecure_no_auth": False,
    }
    assert config.ignored == ["vmargs"]
    settings = load_settings(ts_config=path, queue_size=7)
    assert settings.inference_address == "0.0.0.0:9080"
    assert settings.queue_size == 7


def test_env_and_command_line_win_over_ts_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.properties"
    path.write_text("job_queue_size=5\ndefault_response_timeout=9\n")
    monkeypatch.setenv("SCRIPTSERVE_QUEUE_SIZE", "6")
    settings = load_settings(ts_config=path)
    assert (settings.queue_size, settings.response_timeout_s) == (6, 9)
    assert settings.models == []  # TorchServe loads nothing without load_models


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("inference_address=https://h:8443", "terminate TLS in front of it"),
        ("inference_address=http://h", "needs a port"),
        ("job_queue_size=lots", "job_queue_size=lots: expected a whole number"),
        ("models={bad", "models: not valid JSON"),
        ("enable_model_api=yes", "expected true or false"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "config.properties"
    path.write_text(line + "\n")
    with pytest.raises(TorchServeConfigError, match=message):
        read_torchserve_config(path)
    with pytest.raises(SettingsError, match=message):
        load_settings(ts_config=path)
