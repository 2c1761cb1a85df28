"""The CPU image as a session fixture (see buildah.py for how it is built and cached; the build
starts in the background as soon as collection finds a test that needs it, tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import headstart
import pytest

from tests.docker.buildah import BuiltImage, build_default_image, unbuildable_reason


@pytest.fixture(scope="session")
def built_image() -> Iterator[BuiltImage]:
    """The CPU image, built from this working tree (as root, with buildah)."""
    # CI runs as root with the tools installed by .ci/run: there the test must run, not skip.
    skip = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    reason = unbuildable_reason()
    if reason:
        skip(reason)
    yield headstart.result("image", build_default_image)
