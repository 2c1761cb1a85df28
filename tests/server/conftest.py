"""Fixtures for integration tests: a model store of real archives and a running server, and a
server of models that answer in parts."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import ServerProcess
from streamstore import (
    BIG_PARTS,
    COUNTER,
    INTERMEDIATE,
    MAX_UNREAD,
    SEND_TIMEOUT_S,
    SLOW_MATMULS,
    TS_STREAMING,
    archive_lm,
)
from testmodels import TinyLM, save_onnx, save_torchscript, trained_tiny_lm
from torchserve.tsarchives import torch_model_archiver, write

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


# -- models that answer in parts (tests/streamstore.py) --------------------------------------
@pytest.fixture(scope="session")
def lm() -> TinyLM:
    return trained_tiny_lm()


@pytest.fixture(scope="session")
def streaming_server(
    tmp_path_factory: pytest.TempPathFactory, lm: TinyLM
) -> Iterator[ServerProcess]:
    """One worker per model, batches gathered for 20 ms, at most MAX_UNREAD parts waiting for
    a client: `tinylm` and `slowlm` (text_generator, ~30 ms a token), `bigparts` (400 parts of
    64 KiB), `counter` (its `count` parameter's parts, then an empty end), `intermediate` (two parts
    sent by a handler that answers once) and `ts_stream` (a
    TorchServe handler sending intermediate responses)."""
    work = tmp_path_factory.mktemp("streaming")
    store = work / "store"
    store.mkdir()
    archive_lm(store, work, "tinylm", save_torchscript(work / "lm.pt", lm), "text_generator")
    slow = copy.deepcopy(lm)  # the same fitted weights (not a second fit), with busy work
    slow.matmuls = SLOW_MATMULS
    archive_lm(store, work, "slowlm", save_torchscript(work / "slow.pt", slow), "text_generator")
    archive_lm(store, work, "bigparts", work / "lm.pt", str(write(work / "big.py", BIG_PARTS)))
    archive_lm(store, work, "counter", work / "lm.pt", str(write(work / "counter.py", COUNTER)))
    handler = str(write(work / "intermediate.py", INTERMEDIATE))
    archive_lm(store, work, "intermediate", work / "lm.pt", handler)
    write(work / "ts_stream.py", TS_STREAMING)
    torch_model_archiver(
        work, store, "ts_stream", "--serialized-file", "lm.pt", "--handler", "ts_stream.py"
    )
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--max-batch-delay",
        "20",
        "--enable-model-api",
        "--stream-max-unread-parts",
        str(MAX_UNREAD),
        "--http-send-timeout-s",
        str(SEND_TIMEOUT_S),
    ).start()
    yield proc
    proc.stop()
