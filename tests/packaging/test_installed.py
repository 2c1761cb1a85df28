"""The wheel installed into a fresh virtual environment (as the GPU image installs it: the `gpu`
extra, torch's CPU build here) serves: it archives a model, registers it from an allowed URL
through the management API and answers a prediction; ONNX Runtime's CUDA build, on a machine
without a GPU, serves an ONNX model on the CPU.

Nothing of the development environment stands in for the installed one: the archive is built by
the venv's `model-archiver`, the server runs from the venv's `scriptserve`, and the test
registers and predicts with urllib."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serving import ServerProcess
from testmodels import reference_output, save_onnx, save_torchscript

import scriptserve

# The first test to use the venv waits for its install (about a minute with pip's cache warm).
# Slow: a fresh virtual environment installed from the wheel.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROW = [0.5, -1.0, 0.25, 2.0, 0.0, 1.5, -0.5, 0.75]


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def archive_site(tmp_path: Path) -> Iterator[str]:
    """A loopback HTTP server (http.server) serving a folder; yields its base URL. The folder
    is `tmp_path / "site"`."""
    site = tmp_path / "site"
    site.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(site)))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def call(method: str, url: str, body: bytes | None = None, **headers: str) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def test_installed_commands_print_the_version(runtime_venv: Path) -> None:
    for command in (["scriptserve", "--version"], ["model-archiver", "--version"]):
        done = subprocess.run(
            [str(runtime_venv / command[0]), *command[1:]],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert scriptserve.__version__ in done.stdout


def test_register_from_url_and_predict(
    runtime_venv: Path,
    archive_site: str,
    tmp_path: Path,
    installed_server: Callable[..., ServerProcess],
) -> None:
    model = save_torchscript(tmp_path / "tiny.pt")
    site = tmp_path / "site"
    archived = subprocess.run(
        [
            str(runtime_venv / "model-archiver"),
            "--model-name",
            "tiny",
            "--version",
            "1.0",
            "--serialized-file",
            str(model),
            "--input-shape",
            "8",
            "--export-path",
            str(site),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert archived.returncode == 0, archived.stderr
    assert (site / "tiny.mar").is_file()

    store = tmp_path / "store"
    store.mkdir()
    allowed = json.dumps([re.escape(archive_site) + "/.*"])
    server = installed_server(
        runtime_venv,
        store,
        "--enable-model-api",
        "--workers",
        "1",
        cwd=tmp_path,
        env={"SCRIPTSERVE_ALLOWED_URLS": allowed},
    )

    url = urllib.parse.quote(f"{archive_site}/tiny.mar", safe="")
    key = server.mgmt_headers["Authorization"]
    status, answer = call("POST", f"{server.mgmt}/models?url={url}", Authorization=key)
    assert status == 200, f"{answer}\n{server.output()}"
    assert (store / "tiny.mar").is_file()

    status, answer = call("POST", f"{server.url}/predictions/tiny", json.dumps(ROW).encode())
    assert status == 200, f"{answer}\n{server.output()}"
    expected = reference_output(np.array([ROW], dtype=np.float32))[0]
    np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-6)

    # onnxruntime-gpu (the gpu extra) falls back to its CPU provider where there is no GPU.
    onnx_model = save_onnx(tmp_path / "tiny.onnx")
    archived = subprocess.run(
        [
            str(runtime_venv / "model-archiver"),
            "--model-name",
            "tiny_onnx",
            "--version",
            "1.0",
            "--serialized-file",
            str(onnx_model),
            "--input-shape",
            "8",
            "--export-path",
            str(site),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert archived.returncode == 0, archived.stderr
    url = urllib.parse.quote(f"{archive_site}/tiny_onnx.mar", safe="")
    status, answer = call("POST", f"{server.mgmt}/models?url={url}", Authorization=key)
    assert status == 200, f"{answer}\n{server.output()}"
    status, answer = call("POST", f"{server.url}/predictions/tiny_onnx", json.dumps(ROW).encode())
    assert status == 200, f"{answer}\n{server.output()}"
    np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-5)
