"""One short, real training run shared by the export and serving tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pt2models import inductor_cache

from scriptserve.training.export import FORMATS
from scriptserve.training.run import TrainConfig, TrainResult, train

# Six epochs on the whole training split: ~97 % test accuracy, a few seconds on 2 cores.
SHORT_RUN = TrainConfig(model="lenet", epochs=6, seed=0, progress=False)


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, TrainResult]:
    out = tmp_path_factory.mktemp("trained") / "store"
    config = TrainConfig(**{**SHORT_RUN.__dict__, "out": out, "formats": FORMATS})  # fmt: skip
    with inductor_cache():  # the .pt2 packages compile with the tests' Inductor cache
        return config, train(config)


SmallRun = Callable[..., TrainConfig]


@pytest.fixture
def small_run() -> SmallRun:
    """A quick configuration: 400 training images, 2 epochs, no exports; `out` first."""

    def make(out: Path, **changes: object) -> TrainConfig:
        base = {**SHORT_RUN.__dict__, "out": out, "epochs": 2, "train_limit": 400,
                "formats": ()}  # fmt: skip
        return TrainConfig(**{**base, **changes})  # type: ignore[arg-type]

    return make
