"""The CPU image as a session fixture (see buildah.py for how it is built and cached)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.docker.buildah import BuiltImage, build_image, missing_tools, pick_storage


@pytest.fixture(scope="session")
def built_image() -> Iterator[BuiltImage]:
    """The CPU image, built from this working tree (as root, with buildah)."""
    # CI runs as root with the tools installed by .ci/run: there the test must run, not skip.
    skip = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if os.geteuid() != 0:
        skip("building images with buildah needs root")
    if missing_tools():
        skip(f"needs {', '.join(missing_tools())} (apt-get install buildah podman debootstrap)")
    yield build_image(pick_storage())
