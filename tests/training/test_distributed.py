"""`torchrun`: two gloo ranks train in lockstep; an elastic restart resumes from the checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from serving import free_port

from scriptserve.archiver.archive import verify_archive
from scriptserve.training.checkpoint import load_checkpoint

# Slow: training runs under torchrun.
pytestmark = pytest.mark.slow

QUICK = ["--epochs", "2", "--train-limit", "300", "--no-progress"]


def torchrun(*args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_two_ranks_end_with_identical_weights(tmp_path: Path) -> None:
    proc = torchrun(
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "scriptserve.training",
        *QUICK,
        "--formats",
        "torchscript",
        "--out",
        str(tmp_path / "store"),
        "--digest-dir",
        str(tmp_path / "digests"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0 = (tmp_path / "digests" / "rank0.sha256").read_text()
    rank1 = (tmp_path / "digests" / "rank1.sha256").read_text()
    assert len(rank0.strip()) == 64 and rank0 == rank1
    assert "[rank 1]: epoch 2/2" in proc.stderr  # both ranks trained
    # Only rank 0 wrote: one archive, and it verifies.
    assert [p.name for p in (tmp_path / "store").glob("*.mar")] == ["digits-torchscript.mar"]
    assert verify_archive(tmp_path / "store" / "digits-torchscript.mar").ok


def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    def run(out: Path, port: int, *extra: str) -> subprocess.CompletedProcess[str]:
        return torchrun(
            "--nnodes=1:2",
            "--nproc_per_node=1",
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf=last_call_timeout=1",
            "-m",
            "scriptserve.training",
            *QUICK,
            "--formats",
            "",
            "--out",
            str(out),
            *extra,
        )

    ports = [free_port()]
    while len(ports) < 2:
        ports += [p for p in (free_port(),) if p not in ports]
    # The two runs are independent, and mostly wait on rendezvous and the restart: at once.
    with ThreadPoolExecutor(2) as pool:
        restarted = pool.submit(run, tmp_path / "restarted", ports[0], "--fail-once-at-epoch", "1")
        clean = pool.submit(run, tmp_path / "clean", ports[1]).result()
        failed_once = restarted.result()
    assert failed_once.returncode == 0, failed_once.stderr[-4000:]
    assert "simulated failure after epoch 1" in failed_once.stderr
    assert "resumed from" in failed_once.stderr and "after epoch 1" in failed_once.stderr

    assert clean.returncode == 0, clean.stderr[-4000:]
    a = load_checkpoint(tmp_path / "restarted" / "digits-training" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "clean" / "digits-training" / "checkpoints" / "last.pt")
    assert a["epoch"] == b["epoch"] == 2
    for key, value in b["model"].items():
        torch.testing.assert_close(a["model"][key], value, rtol=0, atol=1e-6)
