"""Archived handlers that import `handlers.base` (scriptserve before it was one package) or
TorchServe's `ts` keep working; the old names exist only while such a handler is imported or
served, and each worker enters that scope once, not once per batch."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from testmodels import reference_output, save_torchscript

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.handlers import base, legacy_names, loader
from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models.management import Management, Registration
from scriptserve.server.models.registry import ModelRegistry
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.settings import load_settings

OLD_STYLE_HANDLER = """
from handlers.tensor import TensorHandler  # the name archives built before 0.1 use


class OldStyle(TensorHandler):
    def handle(self, requests, context):
        # A lazy import while serving: the old name must still resolve in the worker.
        from handlers.base import InferenceResponse

        responses = super().handle(requests, context)
        assert all(isinstance(r, InferenceResponse) for r in responses)
        return responses
"""


def _legacy_loaded() -> list[str]:
    return [n for n in sys.modules if n in ("handlers", "ts") or n.startswith(("handlers.", "ts."))]


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    work, store = tmp_path / "work", tmp_path / "store"
    work.mkdir()
    handler = work / "old_style.py"
    handler.write_text(textwrap.dedent(OLD_STYLE_HANDLER))
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", "old", "--version", "1.0",
        "--serialized-file", str(save_torchscript(work / "tiny.pt")), "--handler", str(handler),
        "--sample-input", str(sample), "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return store


@pytest.fixture
def entered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times the loader and its workers have entered the legacy-names scope."""
    count = [0]
    real = legacy_names.legacy_names

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        count[0] += 1
        with real():
            yield

    monkeypatch.setattr(loader, "legacy_names", counted)
    yield count


def test_an_old_style_handler_is_served_and_its_names_go_with_it(
    archive: Path, entered: list[int]
) -> None:
    assert not _legacy_loaded()

    async def scenario() -> None:
        settings = load_settings(model_store=archive, workers_per_model=2, enable_model_api=True)
        metrics = ServerMetrics()
        registry = ModelRegistry(settings, metrics, ["cpu"])
        dataplane = DataPlane(registry, metrics, settings)
        management = Management(registry, dataplane.inflight_of, settings)
        dataplane.starting = False
        await management.register(Registration(url="old.mar"))
        after_load = entered[0]
        # The handler file's import, then per worker (2): its warm-up, and its life.
        assert after_load == 5
        # While its workers serve, the old name is scriptserve's module.
        assert importlib.import_module("handlers.base") is base
        x = np.full((1, 8), 0.25, dtype=np.float32)
        for _ in range(20):
            request = InferenceRequest(inputs={"x": x}, outputs=[])
            served = await dataplane.submit("old", None, request, protocol="test")
            assert np.allclose(served.outputs[0][1], reference_output(x), atol=1e-5)
        assert entered[0] == after_load  # 20 batches entered nothing more
        await management.unregister("old", None)
        await dataplane.close()

    asyncio.run(scenario())
    assert not _legacy_loaded()
