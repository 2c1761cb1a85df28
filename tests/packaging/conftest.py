"""The distribution as users get it: the wheel built from this checkout, a fresh virtual
environment with only that wheel and its runtime dependencies, and `scriptserve serve` started
through a console script from a chosen directory.

This folder has no `__init__.py` on purpose: with tests/ on sys.path it would shadow the
`packaging` library. Its helpers are fixtures.
"""

from __future__ import annotations

import sysconfig
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import distribution
import pytest
from serving import ServerProcess


@pytest.fixture(scope="session")
def checkout_files() -> list[str]:
    """The checkout's files as git would commit them, relative to the repository root."""
    return distribution.checkout_files()


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once per session."""
    return distribution.build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


@pytest.fixture(scope="session")
def dev_scripts() -> Path:
    """Where this environment's console scripts (`scriptserve`, `model-archiver`) are."""
    return Path(sysconfig.get_path("scripts"))


@pytest.fixture(scope="session")
def runtime_venv(installed: tuple[Path, str]) -> Path:
    """The bin/ folder of a fresh virtual environment holding the wheel and its dependencies,
    installed as the GPU image installs them (the `gpu` extra; torch's CPU build here): made
    once per session, in the background from collection on (tests/conftest.py)."""
    return installed[0]


class InstalledServer(ServerProcess):
    """`scriptserve serve` through the console script in `scripts`, run from `cwd`."""

    def __init__(
        self,
        scripts: Path,
        store: Path,
        *args: str,
        cwd: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(store, *args, env=env, command=[str(scripts / "scriptserve")], cwd=cwd)
        self.scripts = scripts


ServerFactory = Callable[..., InstalledServer]


@pytest.fixture
def installed_server() -> Iterator[ServerFactory]:
    """Start servers with `installed_server(scripts, store, *args, cwd=..., env=...)`; every one
    started is stopped at the end of the test."""
    started: list[InstalledServer] = []

    def start(scripts: Path, store: Path, *args: str, **kwargs: object) -> InstalledServer:
        server = InstalledServer(scripts, store, *args, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()
