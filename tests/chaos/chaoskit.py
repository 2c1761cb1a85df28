"""Fixtures for the worker-failure tests: archives whose handler misbehaves on request.

The chaos handler is TinyMLP's tensor handler, except that a request whose first two values are
(code, argument) with a code below asks it to misbehave first:

- SLEEP (argument: seconds) sleeps, then answers normally;
- EXIT (argument: exit code) ends the process, as `os._exit(code)` (137: what an OOM kill reports);
- KILL sends itself SIGKILL.

Its `initialize` appends a line to the file the config's `startLog` names, and exits with code 3
when the file `crashFlag` names exists (a worker that cannot start again).
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import save_onnx, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

SLEEP, EXIT, KILL = 1234.0, 2345.0, 3456.0

CHAOS_HANDLER = """
import os
import signal
import time
from pathlib import Path

from scriptserve.handlers.tensor import TensorHandler


class ChaosHandler(TensorHandler):
    def initialize(self, context):
        config = context.model_config
        if config.get("startLog"):
            with open(config["startLog"], "a") as log:
                log.write(f"{time.time()} {os.getpid()}\\n")
        if config.get("crashFlag") and Path(config["crashFlag"]).exists():
            os._exit(3)
        super().initialize(context)

    def handle(self, requests, context):
        for request in requests:
            x = request.inputs.get("x")
            if x is None or x.size < 2:
                continue
            code, argument = float(x.flat[0]), float(x.flat[1])
            if code == 1234.0:
                time.sleep(argument)
            elif code == 2345.0:
                os._exit(int(argument))
            elif code == 3456.0:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().handle(requests, context)
"""


def build_archive(
    store: Path, work: Path, name: str, model: Path, config: dict[str, Any], chaos: bool = True
) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    config_file = work / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    handler = "tensor"
    if chaos:
        handler_file = work / "chaos_handler.py"
        handler_file.write_text(textwrap.dedent(CHAOS_HANDLER))
        handler = str(handler_file)
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--handler", handler, "--sample-input", str(sample), "--export-path", str(store),
        "--config-file", str(config_file),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return store / f"{name}.mar"


def models_dir(root: Path) -> tuple[Path, Path]:
    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    return save_torchscript(models / "tiny.pt"), save_onnx(models / "tiny.onnx")


def row(first: float = 0.0, second: float = 0.0, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32)
    if first:
        x[0, 0], x[0, 1] = first, second
    return x


def v2_body(x: np.ndarray) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


def infer(
    server: ServerProcess, model: str, x: np.ndarray, timeout_s: float = 60.0
) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=v2_body(x), timeout=timeout_s)


def output(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def describe(server: ServerProcess, model: str) -> dict[str, Any]:
    response = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers, timeout=10)
    assert response.status_code == 200, response.text
    description: dict[str, Any] = response.json()[0]
    return description


def worker_pids(server: ServerProcess, model: str) -> list[int]:
    """The model's worker processes, as children of the server process (psutil)."""
    assert server.proc is not None
    children = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
    pids = [w["pid"] for w in describe(server, model)["workers"] if w.get("pid")]
    assert pids and set(pids) <= children, (pids, children)
    return pids


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The value of one sample (0 when the series does not exist yet)."""
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def status(server: ServerProcess, path: str) -> int:
    return httpx.get(f"{server.url}{path}", timeout=10).status_code


def poll(check: Any, timeout_s: float = 60.0, what: str = "condition") -> Any:
    """Call `check()` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not met within {timeout_s} s")
