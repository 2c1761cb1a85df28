"""Archives built by TorchServe's own torch-model-archiver 0.12 for each handler form."""

from __future__ import annotations

from pathlib import Path

import pytest
from testmodels import save_torchscript
from torchserve.tsarchives import (
    BATCH_CONFIG,
    CLASS_HANDLER,
    ENTRY_POINT_HANDLER,
    FUNCTION_HANDLER,
    MISMATCH_HANDLER,
    torch_model_archiver,
    write,
)


@pytest.fixture(scope="session")
def ts_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("ts_src")
    save_torchscript(src / "tiny.pt")
    write(src / "scores_handler.py", CLASS_HANDLER)
    write(src / "fn_handler.py", FUNCTION_HANDLER)
    write(src / "entry_handler.py", ENTRY_POINT_HANDLER)
    write(src / "mismatch_handler.py", MISMATCH_HANDLER)
    write(src / "batch.yaml", BATCH_CONFIG)
    return src


@pytest.fixture(scope="session")
def ts_store(ts_sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One archive per handler form: built-in, class, function module, file:function."""
    store = tmp_path_factory.mktemp("ts_store")
    common = ("--serialized-file", "tiny.pt")
    torch_model_archiver(ts_sources, store, "builtin", *common, "--handler", "base_handler")
    torch_model_archiver(
        ts_sources,
        store,
        "scores",
        *common,
        "--handler",
        "scores_handler.py",
        "--config-file",
        "batch.yaml",
    )
    torch_model_archiver(
        ts_sources,
        store,
        "function",
        *common,
        "--handler",
        "fn_handler.py",
        "--config-file",
        "batch.yaml",
    )
    torch_model_archiver(
        ts_sources,
        store,
        "entry",
        *common,
        "--handler",
        "entry_handler:predict",
        "--config-file",
        "batch.yaml",
    )
    return store
