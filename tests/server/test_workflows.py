"""TorchServe workflows, unmodified: `.war` archives made by torch-workflow-archiver (from PyPI)
over `.mar` archives made by torch-model-archiver, their handlers written as TorchServe's
workflow examples write theirs (a sequential pipeline like the dog-breed example, a parallel one
with an aggregating function like the translation example), registered through `/workflows`
and run by `/wfpredict` on a real server."""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from serving import ServerProcess
from torch import nn
from torchserve.tsarchives import torch_model_archiver, write

# Slow: archives made by TorchServe's tools, and a server.
pytestmark = pytest.mark.slow

STEP_HANDLER = """
import json

import torch
from ts.torch_handler.base_handler import BaseHandler


class Step(BaseHandler):
    # Eight numbers in (a JSON list, or a previous step's {"values": [...]}), eight out.

    def preprocess(self, data):
        rows = []
        for row in data:
            value = row.get("data") or row.get("body")
            if isinstance(value, (bytes, bytearray)):
                value = json.loads(value)
            if isinstance(value, dict):
                value = value["values"]
            rows.append(value)
        return torch.tensor(rows, dtype=torch.float32)

    def postprocess(self, data):
        return [json.dumps({"values": row}) for row in data.tolist()]
"""

WORKFLOW_HANDLER = """
import json


def pre_processing(data, context):
    # The start node: TorchServe's DAG has one; it passes each request's body on.
    if data is None:
        return data
    rows = []
    for row in data:
        body = row.get("data") or row.get("body")
        if isinstance(body, (bytes, bytearray)):
            body = body.decode()
        if not isinstance(body, str):
            body = json.dumps(body)
        if json.loads(body) == "fail":
            raise ValueError("asked to fail")
        rows.append(body)
    return rows


def post_processing(data, context):
    if data is None:
        return data
    return [json.dumps({"result": json.loads(row["body"])["values"]}) for row in data]


def aggregate_func(data, context):
    # As the translation example's: each parent's answer under the parent's node name.
    if data is None:
        return data
    return [
        json.dumps(
            {
                "double": json.loads(row["double"])["values"],
                "plus_one": json.loads(row["plus_one"])["values"],
            }
        )
        for row in data
    ]
"""

SEQUENTIAL = """
models:
    min-workers: 1
    max-workers: 1
    batch-size: 8
    max-batch-delay: 20
    retry-attempts: 1
    timeout-ms: 30000

    double:
      url: double.mar

    plus_one:
      url: plus_one.mar
      batch-size: 4

dag:
  pre_processing: [double]
  double: [plus_one]
  plus_one: [post_processing]
"""

PARALLEL = """
models:
    min-workers: 1
    max-workers: 1
    batch-size: 4
    max-batch-delay: 10
    retry-attempts: 1
    timeout-ms: 30000

    double:
      url: double.mar

    plus_one:
      url: plus_one.mar

dag:
  pre_processing: [double, plus_one]
  double: [aggregate_func]
  plus_one: [aggregate_func]
"""

LEAVES = """
models:
    double:
      url: double.mar
    plus_one:
      url: plus_one.mar
dag:
  pre_processing: [double, plus_one]
"""

TWO_STARTS = """
models:
    double:
      url: double.mar
dag:
  pre_processing: [double]
  post_processing: [double]
"""


class Affine(nn.Module):
    def __init__(self, scale: float, shift: float) -> None:
        super().__init__()
        self.scale = scale
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def workflow_archiver(src: Path, out: Path, name: str, spec: str) -> Path:
    write(src / f"{name}.yaml", spec)
    done = subprocess.run(
        [
            "torch-workflow-archiver",
            "--workflow-name",
            name,
            "--spec-file",
            f"{name}.yaml",
            "--handler",
            "workflow_handler.py",
            "--export-path",
            str(out),
            "-f",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=src,
    )
    assert done.returncode == 0, done.stderr
    return out / f"{name}.war"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workflows")
    src, store = root / "src", root / "store"
    src.mkdir()
    store.mkdir()
    write(src / "step_handler.py", STEP_HANDLER)
    write(src / "workflow_handler.py", WORKFLOW_HANDLER)
    for name, scale, shift in (("double", 2.0, 0.0), ("plus_one", 1.0, 1.0)):
        torch.jit.script(Affine(scale, shift)).save(str(src / f"{name}.pt"))
        torch_model_archiver(
            src, store, name, "--serialized-file", f"{name}.pt", "--handler", "step_handler.py"
        )
    for name, spec in (
        ("sequential", SEQUENTIAL),
        ("parallel", PARALLEL),
        ("leaves", LEAVES),
        ("two_starts", TWO_STARTS),
    ):
        workflow_archiver(src, store, name, spec)
    return store


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(store, "--enable-model-api", "--no-snapshot")
    proc.start()
    with httpx.Client(timeout=120, headers=proc.mgmt_headers) as client:
        for name in ("sequential", "parallel", "leaves"):
            registered = client.post(f"{proc.mgmt}/workflows", params={"url": f"{name}.war"})
            assert registered.status_code == 200, registered.text
            assert registered.json() == {
                "status": f"Workflow {name} has been registered and scaled successfully."
            }
    yield proc
    proc.stop()


ROW = [float(i) for i in range(8)]


def predict(server: ServerProcess, name: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/wfpredict/{name}", json=body, timeout=60)


def test_a_sequential_workflow_runs_its_steps_in_order(server: ServerProcess) -> None:
    answer = predict(server, "sequential", ROW)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"result": [2 * x + 1 for x in ROW]}


def test_parallel_branches_meet_in_a_function_by_their_names(server: ServerProcess) -> None:
    answer = predict(server, "parallel", ROW)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"double": [2 * x for x in ROW], "plus_one": [x + 1 for x in ROW]}


def test_several_leaves_answer_together_by_node_name(server: ServerProcess) -> None:
    answer = predict(server, "leaves", ROW)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "double": {"values": [2 * x for x in ROW]},
        "plus_one": {"values": [x + 1 for x in ROW]},
    }


def test_concurrent_requests_batch_at_each_step(server: ServerProcess) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            url = f"{server.url}/wfpredict/sequential"
            rows = [[float(i + j) for j in range(8)] for i in range(24)]
            answers = await asyncio.gather(*(client.post(url, json=row) for row in rows))
            for row, answer in zip(rows, answers, strict=True):
                assert answer.json() == {"result": [2 * x + 1 for x in row]}
            return answers

    assert all(a.status_code == 200 for a in asyncio.run(burst()))
    text = httpx.get(f"{server.metrics_url}/metrics").text
    pattern = (
        r'^scriptserve_batch_size_(sum|count)\{model="sequential__double",version="1.0"\} (\S+)$'
    )
    found = {kind: float(value) for kind, value in re.findall(pattern, text, re.MULTILINE)}
    assert found["sum"] / found["count"] > 1.0  # requests shared batches at that step


def test_management_lists_describes_and_unregisters_workflows(
    server: ServerProcess, store: Path
) -> None:
    with httpx.Client(timeout=60, headers=server.mgmt_headers) as client:
        listed = client.get(f"{server.mgmt}/workflows").json()
        assert {"workflowName": "sequential", "workflowUrl": "sequential.war"} in (
            listed["workflows"]
        )
        described = client.get(f"{server.mgmt}/workflows/sequential").json()[0]
        assert described["batchSize"] == 8 and described["maxBatchDelay"] == 20
        assert described["workflowDag"] == (
            "{pre_processing=['double'], double=['plus_one'], plus_one=['post_processing'], "
            "post_processing=[]}"
        )
        assert described["nodes"]["plus_one"]["batch-size"] == 4
        model = client.get(f"{server.mgmt}/models/sequential__plus_one").json()[0]
        assert model["batchSize"] == 4 and model["maxBatchDelay"] == 20

        refused = client.post(f"{server.mgmt}/workflows", params={"url": "two_starts.war"})
        assert refused.status_code == 400
        assert "exactly one start node" in refused.text
        assert client.get(f"{server.mgmt}/models/two_starts__double").status_code == 404

        registered = client.post(
            f"{server.mgmt}/workflows", params={"url": "leaves.war", "workflow_name": "again"}
        )
        assert registered.status_code == 200, registered.text
        gone = client.delete(f"{server.mgmt}/workflows/again")
        assert gone.json() == {"status": 'Workflow "again" unregistered'}
        assert client.get(f"{server.mgmt}/models/again__double").status_code == 404
        assert predict(server, "again", ROW).status_code == 404


def test_a_failing_step_fails_its_request_alone_and_names_the_step(
    server: ServerProcess,
) -> None:
    failed = predict(server, "sequential", "fail")
    assert failed.status_code >= 500
    assert "step 'pre_processing'" in failed.text
    assert predict(server, "sequential", ROW).json() == {"result": [2 * x + 1 for x in ROW]}
    assert predict(server, "nope", ROW).status_code == 404


def test_the_clients_deadline_covers_the_whole_workflow(server: ServerProcess) -> None:
    late = httpx.post(
        f"{server.url}/wfpredict/sequential",
        json=ROW,
        headers={"X-Request-Timeout": "0.000001"},
        timeout=30,
    )
    assert late.status_code == 504, late.text
    assert "workflow 'sequential'" in late.text


def test_workflows_are_unpacked_only_when_registered_and_removed_at_stop(
    store: Path, tmp_path: Path
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = ServerProcess(store, "--enable-model-api", "--no-snapshot", env={"TMPDIR": str(scratch)})
    proc.start()
    try:
        assert not list(scratch.glob("scriptserve-workflows-*"))  # none registered, none made
        registered = httpx.post(
            f"{proc.mgmt}/workflows",
            params={"url": "sequential.war"},
            headers=proc.mgmt_headers,
            timeout=120,
        )
        assert registered.status_code == 200, registered.text
        (work,) = scratch.glob("scriptserve-workflows-*")
        assert (work / "sequential-0" / "WAR-INF" / "MANIFEST.json").is_file()
    finally:
        assert proc.terminate() == 0, proc.output()
    assert not work.exists()
