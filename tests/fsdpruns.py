"""The training runs the FSDP and torchrun tests read (tests/training/test_fsdp.py,
test_distributed.py): `training` launches `python -m scriptserve.training` in one process or
under torchrun, and `strategy_runs` makes, at once, the same seeded run three ways (one
process, DDP and FSDP on two gloo ranks), a run resumed across world sizes and elastic
restarts. They took about 55 s of the suite one after another (the torchrun tests' own runs 20 to
60 s more); the `fsdp_runs` fixture's head start (tests/conftest.py) begins them at collection,
at low priority, while other tests run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from serving import free_port

from scriptserve.archiver.archive import open_archive
from scriptserve.training.export import run_torchscript

QUICK = ["--epochs", "3", "--train-limit", "300", "--no-progress", "--formats", "torchscript"]
ONE_PROCESS = ["--batch-size", "64"]  # the global batch of two ranks of 32
TWO_RANKS = ["--batch-size", "32"]


@dataclass(frozen=True)
class Run:
    out: Path
    log: str

    @property
    def archive(self) -> Path:
        return self.out / "digits-torchscript.mar"

    @property
    def metrics(self) -> dict[str, object]:
        saved: dict[str, object] = json.loads(
            (self.out / "digits-training" / "metrics.json").read_text()
        )
        return saved

    def logits(self, inputs: np.ndarray) -> np.ndarray:
        with open_archive(self.archive) as reader:
            return run_torchscript(reader.path("model.pt"), inputs)


def training(
    out: Path, *args: str, ranks: int, launcher: tuple[str, ...] = (), **env_vars: str
) -> Run:
    """`python -m scriptserve.training` in one process, or under torchrun on `ranks` ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_vars}
    if ranks == 1 and not launcher:
        cmd = [sys.executable]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        cmd += list(launcher) or ["--standalone", f"--nproc_per_node={ranks}"]
    cmd += ["-m", "scriptserve.training", *QUICK, "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Run(out, proc.stderr)


@dataclass(frozen=True)
class Resumed:
    """A run stopped after epoch 1 on two ranks, resumed in one process and stopped after epoch
    2 (`one`), then resumed on two ranks with CPU offload to its end (`two`)."""

    one: Run
    two: Run
    published_before_the_end: list[str]
    """The archives in its folder after `one`: none, as it stopped twice."""


def resumed_runs(out: Path) -> Resumed:
    training(out, *TWO_RANKS, "--strategy", "fsdp", "--stop-after-epoch", "1", ranks=2)
    one = training(
        out, *ONE_PROCESS, "--strategy", "fsdp", "--resume", "--stop-after-epoch", "2", ranks=1
    )
    published = sorted(p.name for p in out.glob("*.mar"))
    two = training(out, *TWO_RANKS, "--strategy", "fsdp", "--cpu-offload", "--resume", ranks=2)
    return Resumed(one, two, published)


def restarted_run(out: Path) -> Run:
    """FSDP on two ranks under an elastic launcher (one restart allowed), rank 1 failing once
    after epoch 1."""
    launcher = (
        "--nnodes=1:2",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-conf=last_call_timeout=1",
    )
    # Without a fresh store per attempt, the restarted ranks can read the dead ranks' addresses
    # (pytorch/pytorch#135712): DDP and FSDP runs alike fail to reconnect on torch 2.13.
    return training(
        out,
        *TWO_RANKS,
        "--strategy",
        "fsdp",
        "--fail-once-at-epoch",
        "1",
        ranks=2,
        launcher=launcher,
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )


def elastic_run(out: Path, *extra: str) -> Run:
    """DDP (the default strategy) on one rank under an elastic launcher that allows one
    restart."""
    launcher = (
        "--nnodes=1:2",
        "--nproc_per_node=1",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-conf=last_call_timeout=1",
    )
    return training(out, *extra, ranks=1, launcher=launcher)


def strategy_runs(root: Path) -> dict[str, Any]:
    """Every run the FSDP and torchrun tests read (test_fsdp.py, test_distributed.py), at once
    (each launcher on a port of its own), so that one's imports and rendezvous overlap
    another's training: the same seeded training in one process, DDP (its ranks' weight
    digests written) and FSDP on two gloo ranks; the resumed runs; the elastic restarts, FSDP
    on two ranks and DDP on one, with the DDP run it must end like."""
    ddp = (*TWO_RANKS, "--strategy", "ddp", "--digest-dir", str(root / "ddp" / "digests"))
    with ThreadPoolExecutor(7) as pool:
        runs = {
            "one process": pool.submit(training, root / "one", *ONE_PROCESS, ranks=1),
            "ddp": pool.submit(training, root / "ddp", *ddp, ranks=2),
            "fsdp": pool.submit(training, root / "fsdp", *TWO_RANKS, "--strategy", "fsdp", ranks=2),
            "resumed": pool.submit(resumed_runs, root / "resumed"),
            "restarted": pool.submit(restarted_run, root / "restarted"),
            "elastic ddp": pool.submit(elastic_run, root / "elastic"),
            "elastic ddp restarted": pool.submit(
                elastic_run, root / "elastic-restarted", "--fail-once-at-epoch", "1"
            ),
        }
        return {name: future.result() for name, future in runs.items()}
