"""Training: accuracy on real digits, repeatability, resume, AMP, flags, data sharding, CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from serving import run_command
from torch.utils.data import DataLoader

from scriptserve.training import data
from scriptserve.training.checkpoint import load_checkpoint, rng_state, set_rng_state
from scriptserve.training.models import MLP, Net, build_model
from scriptserve.training.run import TrainConfig, TrainResult, train, weights_digest

# Slow: training runs, and the training CLI in a process.
pytestmark = pytest.mark.slow

SmallRun = Callable[..., TrainConfig]


def checkpoint_of(config: TrainConfig) -> dict[str, object]:
    return load_checkpoint(config.run_dir / "checkpoints" / "last.pt")


def test_short_seeded_run_reaches_90_percent(trained: tuple[TrainConfig, TrainResult]) -> None:
    config, result = trained
    assert result.metrics["test_accuracy"] >= 0.90
    assert result.metrics["test_samples"] == 270
    assert [h["epoch"] for h in result.history] == [1, 2, 3, 4, 5, 6]
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    saved = json.loads((config.run_dir / "metrics.json").read_text())
    assert saved["test_accuracy"] == result.metrics["test_accuracy"]
    assert (config.run_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_loads_with_weights_only(trained: tuple[TrainConfig, TrainResult]) -> None:
    config, result = trained
    state = checkpoint_of(config)  # torch.load(..., weights_only=True) inside
    assert state["epoch"] == 6
    assert set(state) >= {"model", "optimizer", "scaler", "rng", "history"}
    net = Net()
    net.load_state_dict(state["model"])  # type: ignore[arg-type]
    assert weights_digest(net) == result.metrics["weights_sha256"]


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path, small_run: SmallRun) -> None:
    digests = []
    for i, seed in enumerate((3, 3, 4)):
        config = small_run(
            tmp_path / f"run{i}",
            seed=seed,
            epochs=1,
            train_limit=300,
            digest_dir=tmp_path / f"d{i}",
        )
        train(config)
        digests.append((tmp_path / f"d{i}" / "rank0.sha256").read_text())
    assert digests[0] == digests[1]
    assert digests[2] != digests[0]


def test_stopped_and_resumed_run_ends_where_uninterrupted_run_ends(
    tmp_path: Path, small_run: SmallRun
) -> None:
    whole = small_run(tmp_path / "whole", epochs=3, train_limit=300)
    result = train(whole)
    assert result.epochs_run == 3

    parted = small_run(tmp_path / "parted", epochs=3, train_limit=300, stop_after_epoch=1)
    first = train(parted)
    assert first.epochs_run == 1 and first.metrics == {}  # stopped: nothing published
    assert checkpoint_of(parted)["epoch"] == 1
    second = train(small_run(tmp_path / "parted", epochs=3, train_limit=300, resume=True))
    assert second.epochs_run == 2  # epochs 2 and 3 only

    a, b = checkpoint_of(whole), checkpoint_of(parted)
    assert a["epoch"] == b["epoch"] == 3
    for key, value in a["model"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=1e-6)  # type: ignore[index]
    assert second.metrics["test_accuracy"] == pytest.approx(result.metrics["test_accuracy"])


def test_rng_state_round_trips_as_plain_types(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_amp_bf16_on_cpu_trains(tmp_path: Path, small_run: SmallRun) -> None:
    result = train(small_run(tmp_path, amp=True, epochs=2))
    assert all(np.isfinite(h["train_loss"]) for h in result.history)
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert result.metrics["amp"] is True


def test_adamw_mlp_streaming_with_workers_anomaly_and_profiler(
    tmp_path: Path, small_run: SmallRun
) -> None:
    config = small_run(
        tmp_path,
        model="mlp",
        optimizer="adamw",
        lr=0.002,
        epochs=1,
        streaming=True,
        num_workers=2,
        detect_anomaly=True,
        profile=True,
    )
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):
        result = train(config)
    assert result.history[0]["train_accuracy"] > 0.2  # chance is 0.1
    trace = json.loads((config.run_dir / "profile" / "trace.json").read_text())
    assert any(
        "conv" in e.get("name", "") or "addmm" in e.get("name", "") for e in trace["traceEvents"]
    )


def test_splits_are_fixed_disjoint_and_preprocessed() -> None:
    a, b = data.load_splits(0), data.load_splits(0)
    assert (len(a.train), len(a.validation), len(a.test)) == (1258, 269, 270)
    assert torch.equal(a.test.labels, b.test.labels)
    assert a.train.images.shape[1:] == (1, 32, 32)
    # The same image never lands in two splits (compare the 8x8 originals).
    train_set = {img.tobytes() for img in a.train.raw}
    assert not any(img.tobytes() in train_set for img in a.test.raw if img.any())
    assert sorted(set(a.test.labels.tolist())) == list(range(10))
    # Normalized with the recorded statistics: roughly zero mean, unit std on the training set.
    assert abs(a.train.images.mean().item()) < 0.05
    assert abs(a.train.images.std().item() - 1.0) < 0.05


@pytest.mark.slow  # a fresh interpreter imports torch: about 5 s
def test_the_digits_are_scikit_learns_read_without_importing_it() -> None:
    from sklearn.datasets import load_digits

    images, target = data.load_digits()
    digits = load_digits()
    assert images.dtype == digits.images.dtype and np.array_equal(images, digits.images)
    assert np.array_equal(target, digits.target)
    script = (
        "import sys; from scriptserve.training import data; images, _ = data.load_digits(); "
        "print(images.shape, 'sklearn' in sys.modules)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert loaded.stdout.split() == ["(1797,", "8,", "8)", "False"]


def _seen(loader: DataLoader[tuple[torch.Tensor, torch.Tensor]]) -> list[bytes]:
    return [img.numpy().tobytes() for images, _ in loader for img in images]


@pytest.mark.parametrize("kind", ["stream", "map"])
def test_sharding_across_ranks_and_workers(kind: str) -> None:
    split = data.load_splits(0, limit=101).train
    seen: list[list[bytes]] = []
    for rank in range(2):
        dataset = data.DigitsStream(split) if kind == "stream" else data.DigitsDataset(split)
        loader = data.make_loader(dataset, 8, seed=5, num_workers=2, rank=rank, world_size=2)
        data.set_loader_epoch(loader, 3)
        seen.append(_seen(loader))
    assert len(seen[0]) == len(seen[1]) == 51  # ceil(101 / 2): equal steps on every rank
    everything = {img.numpy().tobytes() for img in split.images}
    assert set(seen[0]) | set(seen[1]) == everything  # every sample, padding repeats one
    assert len(seen[0]) + len(seen[1]) - len(everything) == 1


def test_stream_order_depends_on_epoch_only() -> None:
    split = data.load_splits(0, limit=50).train
    stream = data.DigitsStream(split, seed=1)
    stream.set_epoch(2)
    again = data.DigitsStream(split, seed=1)
    again.set_epoch(2)
    assert stream.indices() == again.indices()
    again.set_epoch(3)
    assert stream.indices() != again.indices()
    assert stream.indices(0, 2) + stream.indices(1, 2) != stream.indices()  # interleaved shards
    assert sorted(stream.indices(0, 2) + stream.indices(1, 2)) == sorted(stream.indices())


def test_model_registry() -> None:
    assert isinstance(build_model("lenet"), Net) and isinstance(build_model("mlp"), MLP)
    assert build_model("mlp")(torch.zeros(3, 1, 32, 32)).shape == (3, 10)
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        build_model("resnet")


def test_cli_refuses_unknown_format_before_training(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scriptserve.training",
            "--formats",
            "torchscript,tflite",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    assert "unknown format(s) ['tflite']" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_scriptserve_train_runs_the_training_cli(tmp_path: Path) -> None:
    argv = "train --model mlp --epochs 1 --train-limit 200 --formats torchscript --no-progress"
    argv += " --name tiny-digits"
    proc = run_command("scriptserve", *argv.split(), "--out", str(tmp_path), timeout_s=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "tiny-digits-torchscript.mar")
    assert "epoch 1/1" in proc.stderr
    assert (tmp_path / "tiny-digits-training" / "metrics.json").is_file()
