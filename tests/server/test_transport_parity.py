"""One table of good and bad requests, sent over REST and over gRPC to the same server: every
decision is the data plane's, so both transports answer with the same status class and the
same message."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from serving import ServerProcess
from testmodels import save_torchscript
from tritonclient.grpc import service_pb2, service_pb2_grpc

from scriptserve.archiver.cli import model_archiver_main

HANDLERS = {
    "body_only": """
        from scriptserve.handlers.base import BaseHandler, InferenceResponse

        class BodyOnly(BaseHandler):
            def handle(self, requests, context):
                return [InferenceResponse(body={"answer": 1}) for _ in requests]
    """,
    "crashes": """
        from scriptserve.handlers.base import BaseHandler

        class Crashes(BaseHandler):
            def handle(self, requests, context):
                raise ValueError("cannot open /srv/secret/weights.bin")
    """,
    "refuses": """
        from scriptserve.handlers.base import BaseHandler, HandlerError

        class Refuses(BaseHandler):
            def handle(self, requests, context):
                raise HandlerError("row 0 is out of range; send values in [0, 1]", 422)
    """,
}
# HTTP status class -> the gRPC code of the same error.
GRPC_CODE = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: list[int]
    datatype: str = "FP32"
    values: list[float] = field(default_factory=lambda: [0.5] * 8)


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    status: int
    message: str
    inputs: tuple[Tensor, ...] = (Tensor("x", [1, 8]),)
    outputs: tuple[str, ...] = ()
    version: str = ""


CASES = [
    Case("good", "tiny", 200, ""),
    Case("good-output-asked", "tiny", 200, "", outputs=("output0",)),
    Case("good-version", "tiny", 200, "", version="1.0"),
    Case("unknown-model", "nope", 404, "model 'nope' is not registered"),
    Case("unknown-model-bad-input", "nope", 404, "model 'nope' is not registered",
         inputs=(Tensor("x", [1, 8], "FP99"),)),
    Case("unknown-version", "tiny", 404, "model 'tiny' has no version '9' (versions: 1.0)",
         version="9"),
    Case("too-few-values", "tiny", 400, "input 'x': shape [1, 8] needs 8 values, got 7",
         inputs=(Tensor("x", [1, 8], values=[0.5] * 7),)),
    Case("unknown-datatype", "tiny", 400, "input 'x': ",
         inputs=(Tensor("x", [1, 8], "FP99"),)),
    Case("negative-dimension", "tiny", 400,
         "input 'x': 'shape' must be a list of non-negative integers",
         inputs=(Tensor("x", [-1, 8]),)),
    Case("input-twice", "tiny", 400, "input 'x' appears twice",
         inputs=(Tensor("x", [1, 8]), Tensor("x", [1, 8]))),
    Case("unknown-output", "tiny", 400, "unknown output(s) zzz; the model's are output0",
         outputs=("zzz",)),
    Case("body-only-model", "body_only", 400,
         "model 'body_only' answers with a body, not tensors; call /predictions"),
    Case("handler-refuses", "refuses", 422, "row 0 is out of range; send values in [0, 1]"),
    Case("handler-crashes", "crashes", 500, "the handler failed: ValueError"),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("parity")
    work, store = root / "work", root / "store"
    work.mkdir()
    model = save_torchscript(work / "tiny.pt")
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    archives: dict[str, str] = {"tiny": "tensor"}
    for name, source in HANDLERS.items():
        handler = work / f"{name}_handler.py"
        handler.write_text(textwrap.dedent(source))
        archives[name] = str(handler)
    for name, handler in archives.items():
        argv = [
            "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
            "--handler", handler, "--sample-input", str(sample), "--export-path", str(store),
        ]  # fmt: skip
        assert model_archiver_main(argv) == 0
    proc = ServerProcess(store, "--workers", "1").start()
    yield proc
    proc.stop()


def _rest(server: ServerProcess, case: Case) -> tuple[int, str, dict[str, Any]]:
    body: dict[str, Any] = {
        "inputs": [
            {"name": t.name, "shape": t.shape, "datatype": t.datatype, "data": t.values}
            for t in case.inputs
        ]
    }
    if case.outputs:
        body["outputs"] = [{"name": n} for n in case.outputs]
    version = f"/versions/{case.version}" if case.version else ""
    r = httpx.post(f"{server.url}/v2/models/{case.model}{version}/infer", json=body, timeout=30)
    doc = r.json()
    return r.status_code, doc.get("error", ""), doc


def _grpc(server: ServerProcess, case: Case) -> tuple[grpc.StatusCode, str, Any]:
    request = service_pb2.ModelInferRequest(model_name=case.model, model_version=case.version)
    for t in case.inputs:
        tensor = request.inputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        tensor.contents.fp32_contents.extend(t.values)
    for name in case.outputs:
        request.outputs.add(name=name)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return grpc.StatusCode.OK, "", stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", None


def _without_request_id(message: str) -> str:
    return re.sub(r"request id [^ ;)]+", "request id <id>", message)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rest_and_grpc_answer_alike(server: ServerProcess, case: Case) -> None:
    status, rest_message, doc = _rest(server, case)
    code, grpc_message, response = _grpc(server, case)
    assert status == case.status, doc
    assert code is GRPC_CODE[case.status], grpc_message
    assert _without_request_id(rest_message) == _without_request_id(grpc_message)
    assert rest_message.startswith(case.message)
    assert "/srv/secret" not in rest_message + grpc_message
    if status == 200:
        assert doc["model_version"] == response.model_version == "1.0"
        assert [o["name"] for o in doc["outputs"]] == [o.name for o in response.outputs]
        assert [o["name"] for o in doc["outputs"]] == ["output0"]


def test_the_crash_is_logged_with_its_request_id_not_sent(server: ServerProcess) -> None:
    crash = next(c for c in CASES if c.id == "handler-crashes")
    _rest(server, crash)
    log = Path(server.log).read_text()
    assert "cannot open /srv/secret/weights.bin" in log
    assert re.search(r"model=crashes .*request_ids?=\S+", log)
