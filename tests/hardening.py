"""Helpers of the security and chaos tests: TinyMLP archives and the error-body leak check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from testmodels import save_torchscript

from scriptserve.archiver.cli import model_archiver_main

LEAK = re.compile(r"/tmp/|/work/|site-packages|Traceback|File \"|\.py\b|shm|psm_")
"""What an error body must never carry: paths, stack traces, shared-memory names, source files."""


def archive(
    store: Path,
    work: Path,
    name: str,
    version: str = "1.0",
    handler: str = "tensor",
    config: dict[str, object] | None = None,
) -> Path:
    """Build `<name>.mar` of the TinyMLP into `store`; returns it."""
    work.mkdir(parents=True, exist_ok=True)
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    model = work / "tiny.pt"
    if not model.exists():
        save_torchscript(model)
    argv = [
        "--model-name", name, "--version", version, "--serialized-file", str(model),
        "--handler", handler, "--sample-input", str(sample), "--export-path", str(store), "-f",
    ]  # fmt: skip
    if config:
        config_file = work / f"{name}-{version}.yaml"
        config_file.write_text(json.dumps(config))
        argv += ["--config-file", str(config_file)]
    assert model_archiver_main(argv) == 0
    return store / f"{name}.mar"


def assert_no_leak(response: httpx.Response, *secrets: str) -> None:
    """An error body says nothing about the server's insides, nor any key."""
    text = response.text
    assert not LEAK.search(text), text
    for secret in secrets:
        assert secret not in text
