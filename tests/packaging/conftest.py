"""The distribution as users get it: the wheel built from this checkout, a fresh virtual
environment with only that wheel and its runtime dependencies, and `scriptserve serve` started
through a console script from a chosen directory.

This folder has no `__init__.py` on purpose: with tests/ on sys.path it would shadow the
`packaging` library. Its helpers are fixtures.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serving import ServerProcess

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def checkout_files() -> list[str]:
    """The checkout's files as git would commit them (tracked, or untracked and not ignored),
    relative to the repository root: never build outputs, caches or virtual environments."""
    # A virtual environment made in the checkout (`python3 -m venv .venv`) is not ignored by
    # every .gitignore; leave out any folder that is one.
    venvs = [f":(exclude){cfg.parent.name}" for cfg in REPO.glob("*/pyvenv.cfg")]
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", ".", *venvs],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    # A file deleted but not yet staged is still listed.
    return [name for name in listing.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="session")
def wheel(checkout_files: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once per session (about 3 s: no isolated build env).

    It is built from a copy of `checkout_files`, not from the checkout: setuptools reuses the
    checkout's build/lib, where a module deleted since the last build would still sit and ship.
    """
    root = tmp_path_factory.mktemp("wheel")
    sources = root / "src"
    for name in checkout_files:
        (sources / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, sources / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(root / "dist"), str(sources)],
        check=True,
    )  # fmt: skip
    (built,) = (root / "dist").glob("scriptserve-*.whl")
    return built


@pytest.fixture(scope="session")
def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


@pytest.fixture(scope="session")
def dev_scripts() -> Path:
    """Where this environment's console scripts (`scriptserve`, `model-archiver`) are."""
    return Path(sysconfig.get_path("scripts"))


@pytest.fixture(scope="session")
def runtime_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment holding the wheel without extras; yields its bin/ folder.

    Its ~1.2 GB are downloaded or unpacked once per session (about 45 s when pip's cache is
    warm) and deleted at the end. This environment's pip installs into it (`--python`), which
    spares the venv its own pip.
    """
    venv = tmp_path_factory.mktemp("runtime") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
         "--disable-pip-version-check", "-c", str(REPO / "constraints.txt"), str(wheel)],
        check=True,
    )  # fmt: skip
    yield venv / "bin"
    shutil.rmtree(venv, ignore_errors=True)


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
