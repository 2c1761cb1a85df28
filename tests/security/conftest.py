"""Fixtures for the security tests: a model store with the TinyMLP archive `tiny`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hardening import archive


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("secstore")
    path = root / "store"
    archive(path, root / "work", "tiny")
    return path
