"""`make gpu-check` (benchmarks/gpu_check/) here, on the CPU: its dry run goes through every
step the GPU machine runs (the gpu-marked tests, archives compiled for the device, a server
answering REST and gRPC with batching, checked answers, the benchmark), and the wheels it
prepares for that machine fit in what may travel there."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import ANY

import distribution
import psutil
import pytest

from benchmarks import gpu_check


def test_the_check_runs_every_file_that_holds_gpu_tests() -> None:
    marked = sorted(
        str(path.relative_to(distribution.REPO))
        for path in (distribution.REPO / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b|mark\.gpu\b", path.read_text())
    )
    assert marked == sorted(gpu_check.GPU_TESTS)


def test_the_dry_run_goes_through_every_step_on_the_cpu(
    gpu_dry_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, out = gpu_dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert list(steps) == [
        "install",
        "environment",
        "archives",
        "loads",
        "benchmark",
        "served",
        "tests",
    ]
    assert all(step["ok"] for step in steps.values()), steps
    assert result["dry_run"] is True and result["device"] == "cpu"
    assert steps["tests"]["collected"] >= 10  # every gpu test, which the GPU machine runs
    served = steps["served"]
    for model in ("mlp_ts", "mlp_pt2"):
        for how in ("rest", "grpc"):
            assert served[model][f"{how}_max_diff"] <= gpu_check.TOLERANCE
        assert served[model]["mean_batch"] > 1.0
    figures = steps["benchmark"]
    for fmt in ("torchscript", "pt2"):
        for batch in gpu_check.BATCHES:
            assert figures[f"{fmt}_b{batch}"]["items_per_s"] > 0
    assert served["mlp_pt2"]["served_b64"]["of_in_process"] > 0
    loads = steps["loads"]["mlp_pt2"]  # the CPU's package, loaded and run in fresh processes
    assert loads["device"] == "cpu"
    for setup in ("plain", "plain+native_frames"):
        assert loads[setup] == {"exit": 0, "reached": ["loaded", "created", "ran"]}, setup
    assert figures["onnx_cuda"].startswith("not measured")  # this onnxruntime is the CPU build


def test_the_wheels_for_the_gpu_machine_fit_what_may_travel(
    gpu_wheels: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, wheels = gpu_wheels
    assert done.returncode == 0, done.stderr[-3000:]
    names = [p.name for p in wheels.glob("*.whl")]
    assert not [n for n in names if n.startswith("scriptserve-")]  # built there, from the tree
    assert any(n.startswith("grpcio-") and "cp312" in n for n in names)
    assert not [n for n in names if re.match(r"(torch|onnxruntime|nvidia)[-_]", n)]
    assert sum(p.stat().st_size for p in wheels.glob("*.whl")) <= gpu_check.LIMIT_BYTES


def test_each_step_is_written_as_it_ends_and_an_exit_fails_only_its_step(tmp_path: Path) -> None:
    """A check stopped by a time limit still says how far it got; a command-line tool's exit
    inside a step (model-archiver's SystemExit) fails that step, not the check."""
    check = gpu_check.Check(dry_run=True, wheels=None, seconds=0.1)
    check.out = tmp_path / "gpu.json"

    def exits() -> dict[str, object]:
        raise SystemExit(1)

    check.step("archives", exits)
    written = json.loads(check.out.read_text())["steps"]
    assert written["archives"]["ok"] is False and "SystemExit" in written["archives"]["error"]

    check.step("served", lambda: {"mean_batch": 3.0})
    written = json.loads(check.out.read_text())["steps"]
    assert list(written) == ["archives", "served"]
    assert written["served"]["ok"] is True and written["served"]["mean_batch"] == 3.0

    # A step that fails part-way keeps what it found (the other model's answers, the native
    # frames of a crash) beside its error.
    def half_served() -> dict[str, object]:
        found = {"mlp_ts": {"mean_batch": 4.0}, "mlp_pt2": {"error": "exited -11"}}
        raise gpu_check.StepFailed("served: mlp_pt2 failed", found)

    check.step("served", half_served)
    written = json.loads(check.out.read_text())["steps"]["served"]
    assert written["ok"] is False and written["error"] == "served: mlp_pt2 failed"
    assert written["mlp_ts"] == {"mean_batch": 4.0}
    assert written["mlp_pt2"] == {"error": "exited -11"}


STOPPED_CHECK = """
import subprocess, sys, time
from pathlib import Path
from benchmarks import gpu_check

check = gpu_check.Check(dry_run=True, wheels=None, seconds=0.1)
check.out = Path(sys.argv[1])
starting = sys.argv[2] == "starting"


def served():
    # A step's command, as a server or pytest is; "starting": SIGTERM comes while the child,
    # forked, has not yet run it, and subprocess.run has no Popen to kill.
    delay = (lambda: time.sleep(1)) if starting else None
    subprocess.run(["sleep", "60"], check=True, preexec_fn=delay)
    return {}


def steps():
    check.step("archives", lambda: {})
    check.step("served", served)
    check.step("tests", lambda: {})
    return 0


sys.exit(gpu_check.stoppable(check, steps))
"""


@pytest.mark.parametrize("command_is", ["running", "starting"])
def test_a_check_stopped_by_sigterm_ends_what_it_started_and_says_how_far_it_got(
    command_is: str, tmp_path: Path
) -> None:
    out = tmp_path / "gpu.json"
    argv = [sys.executable, "-c", STOPPED_CHECK, str(out), command_is]
    check = subprocess.Popen(argv, cwd=distribution.REPO)
    try:
        deadline = time.monotonic() + 60
        while not (children := psutil.Process(check.pid).children()):
            assert time.monotonic() < deadline and check.poll() is None, "no step started"
            time.sleep(0.05)
        (command,) = children
        check.send_signal(signal.SIGTERM)
        assert check.wait(timeout=30) == 143
    finally:
        check.kill()
    assert not command.is_running()  # killed and reaped, not left behind
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["archives", "served"]  # no step after the stopped one
    assert steps["archives"]["ok"] is True
    assert steps["served"] == {"ok": False, "error": "stopped by SIGTERM", "seconds": ANY}
