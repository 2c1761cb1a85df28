"""Real models made by the tests: small TorchScript and ONNX files, and archives of them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from testmodels import TinyMLP, reference_output, save_onnx, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

__all__ = ["TinyMLP", "reference_output", "save_onnx", "save_torchscript"]


@pytest.fixture
def torchscript_file(tmp_path: Path) -> Path:
    return save_torchscript(tmp_path / "tiny.pt")


@pytest.fixture
def onnx_file(tmp_path: Path) -> Path:
    return save_onnx(tmp_path / "tiny.onnx")


@pytest.fixture
def sample_file(tmp_path: Path) -> Path:
    path = tmp_path / "sample.json"
    path.write_text(json.dumps([0.5] * 8))
    return path


ArchiveFactory = Callable[..., Path]


@pytest.fixture
def make_archive(tmp_path: Path, sample_file: Path) -> ArchiveFactory:
    """Build an archive with model-archiver's own entry point; returns its path."""

    def make(
        model: Path,
        name: str = "tiny",
        fmt: str = "default",
        handler: str = "tensor",
        extra: list[str] | None = None,
        export: Path | None = None,
    ) -> Path:
        export = export or tmp_path / "store"
        argv = [
            "--model-name",
            name,
            "--version",
            "1.0",
            "--serialized-file",
            str(model),
            "--handler",
            handler,
            "--sample-input",
            str(sample_file),
            "--export-path",
            str(export),
            "--archive-format",
            fmt,
            "-f",
            *(extra or []),
        ]
        assert model_archiver_main(argv) == 0
        suffix = {"default": ".mar", "zip-store": ".mar", "tgz": ".tar.gz", "no-archive": ""}[fmt]
        return export / f"{name}{suffix}"

    return make


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; skip them (with the reason) where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
