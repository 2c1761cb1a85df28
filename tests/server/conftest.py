"""Fixtures for integration tests: a model store of real archives and a running server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import ServerProcess
from testmodels import save_onnx, save_torchscript

from scriptserve.archiver.cli import model_archiver_main


def build_store(root: Path) -> Path:
    """`tiny` (TorchScript) and `tiny_onnx` (ONNX) archives of conftest's TinyMLP."""
    store = root / "store"
    models = root / "models"
    models.mkdir(parents=True)
    sample = models / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    for name, path in (
        ("tiny", save_torchscript(models / "tiny.pt")),
        ("tiny_onnx", save_onnx(models / "tiny.onnx")),
    ):
        argv = [
            "--model-name", name, "--version", "1.0", "--serialized-file", str(path),
            "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store),
        ]  # fmt: skip
        assert model_archiver_main(argv) == 0
    return store


@pytest.fixture(scope="module")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="module")
def server(model_store: Path) -> Iterator[ServerProcess]:
    """One server for a test module: both models, 2 workers each, management API enabled."""
    proc = ServerProcess(model_store, "--enable-model-api", "--workers", "2").start()
    yield proc
    proc.stop()
