"""The training runs the FSDP tests compare (tests/training/test_fsdp.py): `training` launches
`python -m scriptserve.training` in one process or under torchrun, and `strategy_runs` makes the
same seeded run three ways (one process, DDP and FSDP on two gloo ranks) at once. The three
take about 18 s of CPU; the `fsdp_runs` fixture's head start (tests/conftest.py) begins them at
collection, at low priority, while other tests wait on servers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Run(out, proc.stderr)


def strategy_runs(root: Path) -> dict[str, Run]:
    """The same seeded training three ways: one process, DDP and FSDP on two gloo ranks.
    Independent runs (each `--standalone` launcher on a port of its own): at once, so that one's
    imports and rendezvous overlap another's training."""
    with ThreadPoolExecutor(3) as pool:
        one = pool.submit(training, root / "one", *ONE_PROCESS, ranks=1)
        ddp = pool.submit(training, root / "ddp", *TWO_RANKS, "--strategy", "ddp", ranks=2)
        fsdp = pool.submit(training, root / "fsdp", *TWO_RANKS, "--strategy", "fsdp", ranks=2)
        return {"one process": one.result(), "ddp": ddp.result(), "fsdp": fsdp.result()}
