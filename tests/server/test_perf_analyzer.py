"""perf_analyzer, Triton's load tool, run unchanged against scriptserve over HTTP (binary tensor
data) and gRPC, at two concurrencies: it reads the model's configuration, loads it, and its
server-side section shows the queue and compute times from the statistics extension.

perf_analyzer ships in the tritonclient wheel (pinned in constraints.txt); it needs Debian's
libb64-0d (.ci/run installs it) and libcudart from the nvidia-cuda-runtime-cu12 wheel (the dev
extra), no GPU. Where it cannot start the test is skipped with the reason, except in CI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import ServerProcess
from testmodels import save_torchscript

from scriptserve.archiver.cli import model_archiver_main

# Slow: perf_analyzer runs against a server.
pytestmark = pytest.mark.slow

SERVER_LINE = re.compile(
    r"Avg request latency: (\d+) usec \(overhead (\d+) usec \+ queue (\d+) usec \+ "
    r"compute input (\d+) usec \+ compute infer (\d+) usec \+ compute output (\d+) usec\)"
)


def perf_analyzer() -> tuple[str, dict[str, str]]:
    """The perf_analyzer command and the environment it starts in."""
    binary = shutil.which("perf_analyzer") or str(Path(sys.executable).parent / "perf_analyzer")
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime

        libs = [str(Path(p) / "lib") for p in nvidia.cuda_runtime.__path__]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")])
    except ImportError:
        pass
    try:
        done = subprocess.run(
            [binary, "--version"], check=False, capture_output=True, text=True, env=env, timeout=30
        )
        why = done.stderr.strip() or done.stdout.strip()
        ok = done.returncode == 0
    except OSError as exc:
        ok, why = False, str(exc)
    if not ok:
        message = f"perf_analyzer cannot start ({why[:300]}); see this module's docstring"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary, env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`tiny` at version "1": perf_analyzer looks its statistics up under an integer version,
    as Triton's are (`std::stoll` of the name)."""
    root = tmp_path_factory.mktemp("perf")
    sample = root / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    model = save_torchscript(root / "tiny.pt")
    argv = [
        "--model-name", "tiny", "--version", "1", "--serialized-file", str(model),
        "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(root / "store"),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    proc = ServerProcess(root / "store", "--workers", "1").start()
    yield proc
    proc.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_scriptserve(server: ServerProcess, protocol: str) -> None:
    binary, env = perf_analyzer()
    url = server.url.removeprefix("http://") if protocol == "http" else server.grpc
    before = httpx.get(f"{server.url}/v2/models/tiny/stats").json()["model_stats"][0]
    cmd = [
        binary, "-m", "tiny", "-i", protocol, "-u", url, "--concurrency-range", "1:2",
        "--measurement-mode", "count_windows", "--measurement-request-count", "100",
        # The test checks what perf_analyzer reports, not how steady a shared machine is.
        "--stability-percentage", "1000", "--max-trials", "10",
    ]  # fmt: skip
    if protocol == "http":
        cmd += ["--input-tensor-format", "binary", "--output-tensor-format", "binary"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=120)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report

    assert "Request concurrency: 1" in report and "Request concurrency: 2" in report
    server_lines = SERVER_LINE.findall(report)
    assert len(server_lines) == 2, report
    for line in server_lines:
        _, _, queue, _, infer, _ = map(int, line)
        assert infer > 0 and queue + infer > 0, report
    counts = [int(n) for n in re.findall(r"Successful request count: (\d+)", report)]
    assert len(counts) == 2 and min(counts) > 0, report

    after = httpx.get(f"{server.url}/v2/models/tiny/stats").json()["model_stats"][0]
    now, was = after["inference_stats"], before["inference_stats"]
    assert now["success"]["count"] - was["success"]["count"] >= sum(counts)
    assert now["fail"]["count"] == was["fail"]["count"]
