"""A handler's exception over REST, from a thread worker and from a process worker: the client
is told that the handler failed, how, and its request id; the exception's text (a path here)
stays in the server's log, next to the model and the request id."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import httpx
import pytest
from hardening import archive, assert_no_leak
from serving import ServerProcess

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

SECRET = "/opt/models/secret-weights.pt"

HANDLER = f"""
from scriptserve.handlers.tensor import TensorHandler


class Leaky(TensorHandler):
    def handle(self, requests, context):
        for request in requests:
            if float(request.inputs["x"].flat[0]) == 13.0:
                raise ValueError("cannot read {SECRET}")
        return super().handle(requests, context)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("handler_failures")
    handler = root / "leaky_handler.py"
    handler.write_text(textwrap.dedent(HANDLER))
    store, work = root / "store", root / "work"
    archive(store, work, "leaky", handler=str(handler))
    archive(store, work, "leaky_process", handler=str(handler), config={"workerMode": "process"})
    proc = ServerProcess(store, "--workers", "1").start(timeout_s=180)
    yield proc
    proc.stop()


def v2_body(request_id: str, first: float) -> dict[str, object]:
    data = [first] + [0.5] * 7
    return {
        "id": request_id,
        "inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": data}],
    }


@pytest.mark.parametrize("model", ["leaky", "leaky_process"])
def test_the_exception_text_goes_to_the_log_not_to_the_client(
    server: ServerProcess, model: str
) -> None:
    request_id = f"{model}-request-1"
    r = httpx.post(
        f"{server.url}/v2/models/{model}/infer", json=v2_body(request_id, 13.0), timeout=60
    )
    assert r.status_code == 500, r.text
    assert r.json()["error"] == (
        f"the handler failed: ValueError (request id {request_id}); see the server log"
    )
    assert SECRET not in r.text
    assert_no_leak(r)

    def logged() -> bool:
        lines = server.output().splitlines()
        at = [i for i, line in enumerate(lines) if f"request_ids={request_id}" in line]
        return bool(at) and any(SECRET in line for line in lines[at[0] :])

    server.wait(lambda _: logged(), 30)
    line = next(x for x in server.output().splitlines() if f"request_ids={request_id}" in x)
    assert f"model={model} version=1.0" in line
    # The worker keeps serving.
    ok = httpx.post(f"{server.url}/v2/models/{model}/infer", json=v2_body("next", 0.5), timeout=60)
    assert ok.status_code == 200, ok.text
