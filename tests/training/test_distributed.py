"""`torchrun`: two gloo ranks train in lockstep; an elastic restart resumes from the checkpoint.
The runs are the `fsdp_runs` fixture's (tests/fsdpruns.py), made at once by its head start."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdpruns import Run

from scriptserve.archiver.archive import verify_archive
from scriptserve.training.checkpoint import load_checkpoint

# Slow: training runs under torchrun.
pytestmark = pytest.mark.slow


def test_two_ranks_end_with_identical_weights(fsdp_runs: dict[str, Any]) -> None:
    ddp: Run = fsdp_runs["ddp"]
    rank0 = (ddp.out / "digests" / "rank0.sha256").read_text()
    rank1 = (ddp.out / "digests" / "rank1.sha256").read_text()
    assert len(rank0.strip()) == 64 and rank0 == rank1
    assert "[rank 1]: epoch 3/3" in ddp.log  # both ranks trained
    # Only rank 0 wrote: one archive, and it verifies.
    assert [p.name for p in ddp.out.glob("*.mar")] == ["digits-torchscript.mar"]
    assert verify_archive(ddp.archive).ok


def test_elastic_restart_resumes_from_the_last_checkpoint(fsdp_runs: dict[str, Any]) -> None:
    """One rank under an elastic launcher, failing once after epoch 1, ends with the weights
    of the same run that never failed."""
    failed_once: Run = fsdp_runs["elastic ddp restarted"]
    clean: Run = fsdp_runs["elastic ddp"]
    assert "simulated failure after epoch 1" in failed_once.log
    assert "resumed from" in failed_once.log and "after epoch 1" in failed_once.log

    checkpoint = ("digits-training", "checkpoints", "last.pt")
    a = load_checkpoint(failed_once.out.joinpath(*checkpoint))
    b = load_checkpoint(clean.out.joinpath(*checkpoint))
    assert a["epoch"] == b["epoch"] == 3
    for key, value in b["model"].items():
        torch.testing.assert_close(a["model"][key], value, rtol=0, atol=1e-6)
