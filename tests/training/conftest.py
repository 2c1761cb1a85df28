"""One short, real training run shared by the export and serving tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import headstart
import pytest
import trainruns
from trainruns import SHORT_RUN

from scriptserve.training.run import TrainConfig, TrainResult


@pytest.fixture(scope="session")
def trained() -> tuple[TrainConfig, TrainResult]:
    """The digits run in every export format (tests/trainruns.py), begun in the background at
    collection (tests/conftest.py)."""
    config, result, _ = headstart.result(
        "trained", functools.partial(trainruns.run_in_child, "digits")
    )
    return config, result


SmallRun = Callable[..., TrainConfig]


@pytest.fixture
def small_run() -> SmallRun:
    """A quick configuration: 400 training images, 2 epochs, no exports; `out` first."""

    def make(out: Path, **changes: object) -> TrainConfig:
        base = {**SHORT_RUN.__dict__, "out": out, "epochs": 2, "train_limit": 400, "formats": ()}
        return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]

    return make
