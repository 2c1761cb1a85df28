"""FSDP2 against DDP and one process; sharded checkpoints that resume on another world size.

Every comparison keeps the global batch: `--batch-size` is per process, and the sampler gives
rank r of R every R-th sample of the epoch's order, so one process on batches of 64 sees, step
by step, exactly the samples that two ranks see on batches of 32. What is left between the runs
is the order of floating-point sums (gradients averaged over ranks, FSDP's reduce-scatter).
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fsdpruns import TWO_RANKS, Resumed, Run, training
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from scriptserve.archiver.archive import open_archive
from scriptserve.training import data
from scriptserve.training.distributed import DistInfo
from scriptserve.training.models import Net
from scriptserve.training.run import TrainConfig, train
from scriptserve.training.sharded_checkpoint import (
    CheckpointError,
    latest_sharded,
    load_sharded,
    save_sharded,
)
from scriptserve.training.strategy import precision

LOGIT_ATOL = 1e-5
WEIGHT_ATOL = 1e-6
LOSS_ATOL = 1e-6
LENET_PARAMETERS = 61706
EPOCH_LINE = re.compile(
    r"\[rank 0\]: epoch 3/3 train_loss=\d\.\d{4} train_acc=\d\.\d{4} val_loss=\d\.\d{4} "
    r"val_acc=\d\.\d{4} \(\d+\.\d+s, \d+ samples/s\)"
)
SHARE_LINE = re.compile(r"\[rank (\d)\]: (\w+): this rank holds (\d+) of (\d+) parameters")


@pytest.fixture(scope="module")
def test_inputs() -> np.ndarray:
    return data.load_splits(0).test.images.numpy()


def max_logit_difference(a: Run, b: Run, inputs: np.ndarray) -> float:
    return float(np.abs(a.logits(inputs) - b.logits(inputs)).max())


@pytest.mark.slow
def test_fsdp_ddp_and_one_process_end_within_tolerance(
    fsdp_runs: dict[str, Any], test_inputs: np.ndarray
) -> None:
    strategies: dict[str, Run] = {n: fsdp_runs[n] for n in ("one process", "ddp", "fsdp")}
    one, ddp, fsdp = strategies.values()
    assert max_logit_difference(fsdp, ddp, test_inputs) <= LOGIT_ATOL
    assert max_logit_difference(fsdp, one, test_inputs) <= LOGIT_ATOL
    assert max_logit_difference(ddp, one, test_inputs) <= LOGIT_ATOL
    losses = {name: run.metrics["history"][-1]["train_loss"] for name, run in strategies.items()}  # type: ignore[index]
    assert max(losses.values()) - min(losses.values()) <= LOSS_ATOL, losses
    accuracies = {run.metrics["test_accuracy"] for run in strategies.values()}
    assert len(accuracies) == 1, accuracies  # the same images right, whichever strategy
    for name, run in strategies.items():
        assert EPOCH_LINE.search(run.log), (name, run.log[-2000:])  # loss, accuracy, samples/s
        assert (run.out / "digits-training" / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert fsdp.metrics["strategy"] == "fsdp" and fsdp.metrics["world_size"] == 2


@pytest.mark.slow
def test_each_fsdp_rank_holds_half_of_the_parameters(fsdp_runs: dict[str, Any]) -> None:
    found = SHARE_LINE.finditer(fsdp_runs["fsdp"].log)
    shares = {int(m[1]): (m[2], int(m[3]), int(m[4])) for m in found}
    assert shares == {
        0: ("fsdp", LENET_PARAMETERS // 2, LENET_PARAMETERS),
        1: ("fsdp", LENET_PARAMETERS // 2, LENET_PARAMETERS),
    }  # every LeNet layer has an even number of rows: exactly half each
    ddp = {int(m[1]): int(m[3]) for m in SHARE_LINE.finditer(fsdp_runs["ddp"].log)}
    assert ddp == {0: LENET_PARAMETERS, 1: LENET_PARAMETERS}
    # Only the main rank published: one archive, one test-accuracy line, from rank 0.
    assert [p.name for p in fsdp_runs["fsdp"].out.glob("*.mar")] == ["digits-torchscript.mar"]
    assert "[rank 0]: test accuracy" in fsdp_runs["fsdp"].log
    assert "[rank 1]: test accuracy" not in fsdp_runs["fsdp"].log
    assert "[rank 1]: epoch 3/3" in fsdp_runs["fsdp"].log  # both ranks trained


@pytest.mark.slow
def test_archive_is_the_same_whichever_strategy_trained_it(fsdp_runs: dict[str, Any]) -> None:
    def contents(run: Run) -> tuple[list[str], dict[str, torch.Tensor], object]:
        with open_archive(run.archive) as reader:
            files = sorted(str(p.relative_to(reader.root)) for p in reader.root.rglob("*"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated
                module = torch.jit.load(str(reader.path("model.pt")))  # type: ignore[no-untyped-call]
            signature = reader.manifest.scriptserve.signature  # type: ignore[union-attr]
        return files, dict(module.state_dict()), signature

    files, weights, signature = contents(fsdp_runs["one process"])
    assert weights["fc1.weight"].shape == (120, 400)  # whole, unsharded weights
    for name in ("ddp", "fsdp"):
        other_files, other_weights, other_signature = contents(fsdp_runs[name])
        assert (other_files, other_signature) == (files, signature), name
        assert other_weights.keys() == weights.keys(), name
        for key, value in weights.items():
            torch.testing.assert_close(other_weights[key], value, rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_on_one_process_then_on_two_ranks(
    fsdp_runs: dict[str, Any], test_inputs: np.ndarray
) -> None:
    """Epoch 1 on two ranks, epoch 2 in one process, epoch 3 on two ranks with CPU offload
    (fsdpruns.resumed_runs)."""
    resumed: Resumed = fsdp_runs["resumed"]
    one, two = resumed.one, resumed.two
    assert "(written by 2 ranks, read by 1)" in one.log
    assert "resumed from" in one.log and "after epoch 1" in one.log
    assert "epoch 1/3" not in one.log and "epoch 2/3" in one.log and "epoch 3/3" not in one.log
    assert not resumed.published_before_the_end  # stopped twice: nothing published yet
    assert "(written by 1 rank, read by 2)" in two.log and "cpu offload on" in two.log
    assert [h["epoch"] for h in two.metrics["history"]] == [1, 2, 3]  # type: ignore[attr-defined]
    assert max_logit_difference(two, fsdp_runs["fsdp"], test_inputs) <= LOGIT_ATOL
    assert max_logit_difference(two, fsdp_runs["one process"], test_inputs) <= LOGIT_ATOL


@pytest.mark.slow
def test_elastic_restart_resumes_fsdp_from_its_sharded_checkpoint(
    fsdp_runs: dict[str, Any], test_inputs: np.ndarray
) -> None:
    """Two ranks under an elastic launcher, one failing once after epoch 1
    (fsdpruns.restarted_run)."""
    restarted: Run = fsdp_runs["restarted"]
    assert "simulated failure after epoch 1" in restarted.log
    assert "(written by 2 ranks, read by 2)" in restarted.log
    assert "[rank 1]: resumed from" in restarted.log and "after epoch 1" in restarted.log
    assert max_logit_difference(restarted, fsdp_runs["fsdp"], test_inputs) <= LOGIT_ATOL


def test_sharded_checkpoint_round_trips_in_one_process(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, info = Net(), DistInfo()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 32, 32)).sum().backward()
    optimizer.step()
    state = {"epoch": 3, "history": [{"epoch": 3.0, "train_loss": 0.5}], "scaler": {}}
    save_sharded(tmp_path, model, optimizer, state, info)
    assert latest_sharded(tmp_path) == tmp_path / "epoch-0003"

    fresh = Net()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.5)
    loaded = load_sharded(tmp_path, fresh, fresh_optimizer, info)

    assert loaded is not None and loaded["epoch"] == 3 and loaded["history"] == state["history"]
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1  # the saved settings, not the new ones
    for old, new in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(
            fresh_optimizer.state[new]["momentum_buffer"], optimizer.state[old]["momentum_buffer"]
        )


class MakesDirectory:
    """A pickle that calls os.makedirs when loaded: what an unrestricted unpickler would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.makedirs, (str(self.path),)


def test_sharded_checkpoint_with_arbitrary_pickles_is_refused(tmp_path: Path) -> None:
    model, info = Net(), DistInfo()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_sharded(tmp_path, model, optimizer, {"epoch": 1}, info)
    metadata = tmp_path / "epoch-0001" / ".metadata"
    marker, fresh = tmp_path / "ran", Net()
    metadata.write_bytes(pickle.dumps(MakesDirectory(marker)))
    with pytest.raises(CheckpointError, match=r"os\.makedirs, which is not part of"):
        load_sharded(tmp_path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), info)
    assert not marker.exists()

    # A checkpoint that stores a weight as a pickled object (DCP would unpickle it with
    # weights_only=False) is refused as well.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    model_state["fc3.bias"] = MakesDirectory(marker)  # type: ignore[assignment]
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        metadata.unlink()
        dcp_save(
            {"model": model_state, "optimizer": optimizer_state["state"]},
            checkpoint_id=metadata.parent,
        )
    with pytest.raises(CheckpointError, match=r"stores model\.fc3\.bias as pickled"):
        load_sharded(tmp_path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), info)
    assert not marker.exists()


@pytest.mark.slow
def test_checkpoint_of_the_other_strategy_is_not_resumed(tmp_path: Path) -> None:
    base = TrainConfig(
        model="mlp", epochs=1, train_limit=64, formats=(), progress=False, out=tmp_path
    )
    train(base)  # ddp (one process): last.pt
    fsdp = TrainConfig(**{**base.__dict__, "strategy": "fsdp", "resume": True, "epochs": 2})
    with pytest.raises(ValueError, match="written by a ddp run; resume it with --strategy ddp"):
        train(fsdp)


def test_strategy_and_cpu_offload_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        TrainConfig(strategy="zero3").check()
    with pytest.raises(ValueError, match="use it with strategy fsdp"):
        TrainConfig(strategy="ddp", cpu_offload=True).check()
    TrainConfig(strategy="fsdp", cpu_offload=True).check()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_fsdp_on_cuda_uses_a_mixed_precision_policy_instead_of_autocast() -> None:
    cuda, two = torch.device("cuda", 0), DistInfo(world_size=2)
    amp, policy = precision("fsdp", cuda, True, two)
    assert policy is not None and not amp.enabled  # FSDP casts; the loop does not autocast
    assert policy.param_dtype in (torch.bfloat16, torch.float16)
    assert policy.reduce_dtype == torch.float32  # gradients reduced in full precision
    assert amp.scaler.is_enabled() == (policy.param_dtype == torch.float16)
    ddp_amp, none = precision("ddp", cuda, True, two)
    assert none is None and ddp_amp.enabled and ddp_amp.dtype == torch.float16
    assert precision("fsdp", cuda, False, two)[1] is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fsdp_on_two_gpus_trains_over_nccl_in_mixed_precision(tmp_path: Path) -> None:
    run = training(
        tmp_path / "store",
        *TWO_RANKS,
        "--strategy",
        "fsdp",
        "--device",
        "cuda",
        "--amp",
        "--cpu-offload",
        ranks=2,
    )
    assert "fsdp over 2 ranks (nccl)" in run.log
    assert re.search(r"mixed precision torch\.(bfloat16|float16)", run.log)
    assert run.metrics["test_accuracy"] > 0.5  # type: ignore[operator]
    assert run.archive.is_file()
