"""The distribution as users get it, built from this checkout: its files as git would commit
them, the wheel, and a fresh virtual environment holding the wheel as the GPU image installs it.

Plain functions, so that the slow one (the environment) can get a head start (headstart.py);
tests/packaging/conftest.py wraps them as fixtures.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import headstart

REPO = Path(__file__).resolve().parents[1]


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


def build_wheel(root: Path) -> Path:
    """The wheel of this checkout, built under `root` (about 3 s: no isolated build env).

    It is built from a copy of the checkout's files, not from the checkout: setuptools reuses
    the checkout's build/lib, where a module deleted since the last build would still sit and
    ship.
    """
    sources = root / "src"
    for name in checkout_files():
        (sources / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, sources / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "dist"),
            str(sources),
        ],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(sources)
    (built,) = (root / "dist").glob("scriptserve-*.whl")
    return built


def gpu_layer() -> tuple[Path, str]:
    """The GPU image's Python layer made on this machine as docker/Dockerfile.gpu makes it: the
    wheel from `docker/wheelhouse.sh --project-only`, then `docker/gpu-layer.sh` (torch from
    pip's own index here, the CPU build, in place of the CUDA index), without compiling each
    package's bytecode (PIP_COMPILE=0, pip's --no-compile: an image keeps its bytecode to start
    faster, this environment is deleted after the tests). Returns the environment's bin/ folder
    and what the script printed; the caller deletes `bin/../..` when done."""
    root = Path(tempfile.mkdtemp(prefix="scriptserve-gpu-layer-"))
    subprocess.run(
        [str(REPO / "docker" / "wheelhouse.sh"), "--project-only", str(root / "wheels")],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    done = subprocess.run(
        [str(REPO / "docker" / "gpu-layer.sh"), str(root / "venv"), str(root / "wheels")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TORCH_INDEX_URL": "", "PIP_COMPILE": "0"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"gpu-layer.sh failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return root / "venv" / "bin", done.stdout


def gpu_check(option: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`python -m benchmarks.gpu_check` with `--dry-run` (the path is its results file) or
    `--prepare` (the path is the folder of wheels it prepared), into a fresh temporary folder
    that the caller deletes: about half a minute each alone, so they get a head start. They run
    at low priority beside the rest of the suite, which on a slower 2-core machine stretched the
    dry run past ten minutes: the bound is the head start's own (headstart.result)."""
    root = Path(tempfile.mkdtemp(prefix="scriptserve-gpu-check-"))
    if option == "--dry-run":
        path, argv = root / "gpu.json", ["--dry-run", "--seconds", "0.5", "--out"]
    else:
        path, argv = root / "wheels", ["--prepare"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *argv, str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=headstart.TIMEOUT_S,
        check=False,
    )
    return done, path
