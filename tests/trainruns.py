"""The two training runs that tests share, each made once per test session in a child process:

- `digits`: LeNet on the digits, every export format (the `trained` fixture,
  tests/training/conftest.py; test_train, test_export and test_served read it);
- `qat`: `InkMLP` with quantization-aware training into a static int8 `.pt2` (test_qat.py).

Each takes half a minute on 2 cores, most of it compiling `.pt2` packages. The conftest's head
start (tests/conftest.py) begins a run at collection when a selected test uses its fixture: the
child runs at low priority while the other tests wait on servers, and the tests that use it run
last. The child writes the run's config, result and log lines to a pickle the parent reads back.

    python tests/trainruns.py digits|qat OUT RESULT_PICKLE
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from pt2models import INDUCTOR_CACHE, inductor_cache, run_child, workdir
from torch import nn

from scriptserve.training import data
from scriptserve.training.export import FORMATS
from scriptserve.training.models import MODELS
from scriptserve.training.run import TrainConfig, TrainResult, train

# Six epochs on the whole training split: ~97 % test accuracy.
SHORT_RUN = TrainConfig(model="lenet", epochs=6, seed=0, progress=False)
FP32_EPOCHS = 20
QAT_EPOCHS = 3

Run = tuple[TrainConfig, TrainResult, list[str]]
"""A run's config, its result and what it logged at INFO on the `training` logger."""


class InkMLP(nn.Module):
    """Pixels and total ink side by side in one tensor, then an MLP (1,025 -> 256 -> 128 -> 10)."""

    def __init__(self, num_classes: int = 10, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32 * 32 + 1, hidden)
        self.fc2 = nn.Linear(hidden, hidden // 2)
        self.fc3 = nn.Linear(hidden // 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pixels = torch.flatten(x, 1)
        ink = (pixels * data.STD + data.MEAN).sum(1, keepdim=True)
        h = F.relu(self.fc1(torch.cat([pixels, ink], 1)))
        h = F.relu(self.fc2(h))
        out: torch.Tensor = self.fc3(h)
        return out


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def config_of(kind: str, out: Path) -> TrainConfig:
    if kind == "digits":
        return dataclasses.replace(SHORT_RUN, out=out, formats=FORMATS)
    if kind == "qat":
        return TrainConfig(
            model="ink-mlp",
            name="ink",
            epochs=FP32_EPOCHS,
            optimizer="adamw",
            lr=0.001,
            seed=5,
            formats=("pt2-int8",),
            qat=True,
            qat_epochs=QAT_EPOCHS,
            out=out,
            progress=False,
        )
    raise ValueError(f"unknown run {kind!r}")


def run_in_child(kind: str) -> Run:
    """The run `kind`, made by `python tests/trainruns.py` in a folder of this session's."""
    root = workdir() / f"train-{kind}"
    root.mkdir()
    result = root / "run.pickle"
    run_child(
        __file__,
        [kind, str(root / "store"), str(result)],
        f"the {kind} training run",
        {"TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE)},
    )
    with result.open("rb") as file:
        run: Run = pickle.load(file)
    return run


def _run_here(kind: str, out: Path) -> Run:
    """What the child of `run_in_child` does."""
    config = config_of(kind, out)
    lines = Lines()
    logger = logging.getLogger("training")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    if kind == "qat":
        MODELS["ink-mlp"] = InkMLP
        # One thread, as the figures in docs/training.md were measured.
        torch.set_num_threads(1)
    with inductor_cache():  # the .pt2 packages compile with the tests' Inductor cache
        return config, train(config), lines.lines


if __name__ == "__main__":
    made = _run_here(sys.argv[1], Path(sys.argv[2]))
    with Path(sys.argv[3]).open("wb") as file:
        pickle.dump(made, file)
