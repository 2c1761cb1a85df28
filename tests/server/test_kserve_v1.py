"""KServe v1 against a real server: the `kserve` package's REST client unchanged, KServe's error
shape, and the inference API's guards (key, body limit, deadline) on the v1 routes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from serving import ServerProcess
from testmodels import SlowMLP, reference_output, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

INFERENCE_KEY = "v1-inference-key-for-tests"
AUTH = {"Authorization": f"Bearer {INFERENCE_KEY}"}
QUEUE_SIZE = 8
MAX_BODY = 4096

EXPLAINER = """
from scriptserve.handlers.base import InferenceResponse
from scriptserve.handlers.tensor import TensorHandler


class Explainer(TensorHandler):
    explains = True

    def handle(self, requests, context):
        answers = super().handle(requests, context)
        return [
            InferenceResponse(body={"prediction": a.body, "explained": True})
            if r.headers.get("explain") == "True" else a
            for r, a in zip(requests, answers)
        ]
"""

# A TorchServe handler (its `ts` base class) with an explain_handle of its own.
TS_EXPLAINER = """
from ts.torch_handler.base_handler import BaseHandler


class RowSums(BaseHandler):
    def explain_handle(self, data_preprocess, raw_data):
        return [{"row_sum": float(row.sum())} for row in data_preprocess]
"""


def _archive(store: Path, work: Path, name: str, model: Path, handler: str) -> None:
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--handler", handler, "--sample-input", str(sample), "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("kserve_v1")
    store, work = root / "store", root / "work"
    work.mkdir()
    tiny = save_torchscript(work / "tiny.pt")
    slow = save_torchscript(work / "slow.pt", SlowMLP())
    handlers = {"explainer.py": EXPLAINER, "ts_explainer.py": TS_EXPLAINER}
    for file, source in handlers.items():
        (work / file).write_text(textwrap.dedent(source))
    for name, model, handler in (
        ("tiny", tiny, "tensor"),
        ("spare", tiny, "tensor"),
        ("slow", slow, "tensor"),
        ("explainer", tiny, str(work / "explainer.py")),
        ("ts_explainer", tiny, str(work / "ts_explainer.py")),
    ):
        _archive(store, work, name, model, handler)
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--queue-size",
        str(QUEUE_SIZE),
        "--max-request-bytes",
        str(MAX_BODY),
        env={"SCRIPTSERVE_INFERENCE_KEY": INFERENCE_KEY},
    ).start()
    yield proc
    proc.stop()


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


# The kserve client runs in its own interpreter: kserve registers the Open Inference Protocol's
# gRPC messages (package `inference`) in protobuf's default pool, as tritonclient and this
# server's own generated code do, and a second registration in one process fails.
KSERVE_CLIENT = """
import asyncio, json, sys

import httpx
from kserve import InferenceRESTClient, RESTConfig


async def main(url, key, calls):
    answers = []
    async with InferenceRESTClient(RESTConfig(protocol="v1", timeout=30)) as client:
        for method, kwargs in calls:
            try:
                result = await getattr(client, method)(
                    url, headers={"Authorization": f"Bearer {key}"}, **kwargs
                )
                answers.append({"result": result})
            except httpx.HTTPStatusError as exc:
                answers.append({"status": exc.response.status_code, "message": str(exc)})
    return answers


print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())))))
"""


def kserve_client(server: ServerProcess, *calls: tuple[str, dict[str, Any]]) -> list[Any]:
    """Each call, `(InferenceRESTClient method, its arguments but the URL and headers)`, made by
    the kserve package's v1 REST client: its result, or the status and message it raised."""
    done = subprocess.run(
        [sys.executable, "-c", KSERVE_CLIENT, server.url, INFERENCE_KEY],
        input=json.dumps(calls),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answers: list[Any] = json.loads(done.stdout)
    return answers


def test_the_kserve_client_checks_health_and_predicts(server: ServerProcess) -> None:
    x = rows(3)
    expected = reference_output(x)
    live, ready, *answers = kserve_client(
        server,
        ("is_server_live", {}),
        ("is_model_ready", {"model_name": "tiny"}),
        ("infer", {"data": {"instances": x.tolist()}, "model_name": "tiny"}),
        # TensorFlow Serving's `inputs`: the instances as a list, or by input name.
        ("infer", {"data": {"inputs": x.tolist()}, "model_name": "tiny"}),
        ("infer", {"data": {"inputs": {"x": x.tolist()}}, "model_name": "tiny"}),
    )
    assert live == {"result": True}
    assert ready == {"result": True}
    for answer in answers:
        assert set(answer["result"]) == {"predictions"}
        predictions = np.asarray(answer["result"]["predictions"])
        np.testing.assert_allclose(predictions, expected, atol=1e-5)


def test_explain_is_501_unless_the_handler_explains(server: ServerProcess) -> None:
    x = rows(2, seed=1)
    data = {"instances": x.tolist()}
    refused, native, ts = kserve_client(
        server,
        *(
            ("explain", {"model_name": model, "data": data})
            for model in ("tiny", "explainer", "ts_explainer")
        ),
    )
    assert refused["status"] == 501
    # The client reads KServe's error shape: the server's message is in its exception.
    message = "model 'tiny' has no explanations (its handler does not implement them)"
    assert message in refused["message"]
    native, ts = native["result"], ts["result"]
    expected = reference_output(x)
    assert [e["explained"] for e in native["explanations"]] == [True, True]
    np.testing.assert_allclose(
        [e["prediction"] for e in native["explanations"]], expected, atol=1e-5
    )
    assert ts == {"explanations": [{"row_sum": pytest.approx(float(r.sum()))} for r in x]}
    # The same handlers still predict.
    predicted = httpx.post(
        f"{server.url}/v1/models/explainer:predict", json={"instances": x.tolist()}, headers=AUTH
    )
    np.testing.assert_allclose(predicted.json()["predictions"], expected, atol=1e-5)


def test_models_are_listed_and_readiness_follows_the_workers(server: ServerProcess) -> None:
    listed = httpx.get(f"{server.url}/v1/models", headers=AUTH)
    assert listed.status_code == 200
    assert listed.json() == {
        "models": sorted(["explainer", "slow", "spare", "tiny", "ts_explainer"])
    }
    scale = f"{server.mgmt}/models/spare?min_worker=%d&synchronous=true"
    ready = ("is_model_ready", {"model_name": "spare"})
    assert httpx.put(scale % 0, headers=server.mgmt_headers, timeout=30).status_code == 200
    try:
        unready = httpx.get(f"{server.url}/v1/models/spare", headers=AUTH)
        assert unready.status_code == 503
        assert unready.json() == {"error": "model 'spare' is not ready; retry later"}
        predict = httpx.post(
            f"{server.url}/v1/models/spare:predict", json={"instances": [[0.0] * 8]}, headers=AUTH
        )
        assert predict.status_code == 503
        assert set(predict.json()) == {"error"}
        assert kserve_client(server, ready) == [{"result": False}]
    finally:
        assert httpx.put(scale % 1, headers=server.mgmt_headers, timeout=30).status_code == 200
    assert kserve_client(server, ready) == [{"result": True}]
    unknown = httpx.get(f"{server.url}/v1/models/nope", headers=AUTH)
    assert (unknown.status_code, unknown.json()) == (
        404,
        {"error": "model 'nope' is not registered"},
    )


BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("not-json", b"{instances", "the request body is not valid JSON"),
    ("not-an-object", b"[[1, 2]]", 'a KServe v1 request must be a JSON object with an "instances"'),
    ("no-instances", b'{"data": [1]}', '"instances" must be a non-empty list'),
    ("empty-instances", b'{"instances": []}', '"instances" must be a non-empty list'),
    ("both", b'{"instances": [[1]], "inputs": [[1]]}', 'send either "instances" or "inputs"'),
    ("ragged-columns", b'{"inputs": {"x": [[1], [2]], "y": [[3]]}}',
     "every input of \"inputs\" needs the same number of instances: 'x' has 2, 'y' has 1"),
    ("wrong-width", json.dumps({"instances": [[0.5] * 8, [0.5] * 3]}).encode(),
     "instance 1: input 'x' has shape [3] per instance; the model expects [8]"),
    ("too-many", json.dumps({"instances": [[0.5] * 8] * (QUEUE_SIZE + 1)}).encode(),
     f"{QUEUE_SIZE + 1} instances are more than model 'tiny' queues ({QUEUE_SIZE})"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "message"), [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES]
)
def test_bad_input_is_400_in_kserve_error_shape(
    server: ServerProcess, body: bytes, message: str
) -> None:
    answer = httpx.post(
        f"{server.url}/v1/models/tiny:predict",
        content=body,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert set(answer.json()) == {"error"}
    assert message in answer.json()["error"]


def test_the_inference_guards_apply_to_v1(server: ServerProcess) -> None:
    body = {"instances": [[0.5] * 8]}
    url = f"{server.url}/v1/models/tiny:predict"
    checks = {
        "no key": httpx.post(url, json=body),
        "too large": httpx.post(url, content=b" " * (MAX_BODY + 1), headers=AUTH),
        "deadline": httpx.post(
            f"{server.url}/v1/models/slow:predict",
            json=body,
            headers={**AUTH, "X-Request-Timeout": "0.01"},
        ),
        "unknown model": httpx.post(
            f"{server.url}/v1/models/nope:predict", json=body, headers=AUTH
        ),
    }
    statuses = {what: answer.status_code for what, answer in checks.items()}
    assert statuses == {"no key": 401, "too large": 413, "deadline": 504, "unknown model": 404}
    for answer in checks.values():
        assert set(answer.json()) == {"error"}, answer.text
    assert "4096 bytes" in checks["too large"].json()["error"]
    assert "deadline" in checks["deadline"].json()["error"]
    # Liveness is a probe: open without the key, like /v2/health/live.
    assert httpx.get(f"{server.url}/").json() == {"status": "alive"}
