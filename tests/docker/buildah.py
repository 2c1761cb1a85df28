"""Build and run docker/Dockerfile with buildah: no Docker engine, no registry.

The base image is made here: a Debian bookworm rootfs (debootstrap --variant=minbase, with
python3 3.11 and its venv module) imported with podman, then passed as the BASE_IMAGE build
argument. Containers run with `buildah run --isolation chroot`, which shares the host's network
and PID namespaces, so the tests call the server on loopback and see its process.

Everything reusable is kept under build/ (gitignored): the base rootfs tarball, the wheelhouse,
and the container storage, where an image whose inputs have not changed is built only once.
Storage uses the overlay driver where the kernel allows it, else vfs (slower, copies layers).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tests.docker")

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "container-test"
BASE_TAG = "localhost/scriptserve-test-base:bookworm"
IMAGE_REPO = "localhost/scriptserve-test"
DEBIAN_MIRROR = os.environ.get("SCRIPTSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Paths a slim base image leaves out: package lists and caches, docs, man pages, locales.
TRIM = (
    "var/lib/apt/lists",
    "var/cache/apt",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/info",
)
# What the image is built from; any change makes a new tag (and so a new build).
IMAGE_INPUTS = (
    "docker/Dockerfile",
    "docker/config.yaml",
    "docker/entrypoint.sh",
    "docker/healthcheck.py",
    "docker/wheelhouse.sh",
    "pyproject.toml",
    "constraints.txt",
    "README.md",
    "archiver",
    "handlers",
    "server",
    "training",
)


def missing_tools() -> list[str]:
    return [t for t in ("buildah", "podman", "debootstrap") if shutil.which(t) is None]


def unbuildable_reason() -> str | None:
    """Why the image cannot be built here, or None."""
    if os.geteuid() != 0:
        return "building images with buildah needs root"
    if missing_tools():
        return f"needs {', '.join(missing_tools())} (apt-get install buildah podman debootstrap)"
    return None


def run(
    cmd: list[str], timeout_s: float = 900, check: bool = True
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:6])}... exited {result.returncode}:\n{result.stdout[-4000:]}"
            f"\n{result.stderr[-4000:]}"
        )
    return result


@dataclass(frozen=True)
class Storage:
    """One container storage under build/, shared by buildah and podman."""

    driver: str

    @property
    def options(self) -> list[str]:
        root = CACHE / f"storage-{self.driver}"
        return [
            "--root",
            str(root),
            "--runroot",
            str(CACHE / f"run-{self.driver}"),
            "--storage-driver",
            self.driver,
        ]

    def buildah(self, *args: str) -> list[str]:
        return ["buildah", *self.options, *args]

    def podman(self, *args: str) -> list[str]:
        return ["podman", *self.options, *args]

    def has_image(self, tag: str) -> bool:
        return run(self.buildah("inspect", "--type", "image", tag), check=False).returncode == 0

    def image_config(self, tag: str) -> dict[str, object]:
        """The Docker-format config (Entrypoint, User, Healthcheck, ExposedPorts, ...)."""
        data = json.loads(run(self.buildah("inspect", "--type", "image", tag)).stdout)
        config: dict[str, object] = data["Docker"]["config"]
        return config

    def image_size(self, tag: str) -> int:
        """Bytes of all the image's layers, uncompressed (what `docker images` shows)."""
        (data,) = json.loads(run(self.podman("image", "inspect", tag)).stdout)
        return int(data["Size"])


def pick_storage() -> Storage:
    """overlay when a container built on it can be mounted here, else vfs."""
    overlay = Storage("overlay")
    probe = run(overlay.buildah("from", "scratch"), check=False)
    if probe.returncode == 0:
        name = probe.stdout.strip()
        mounted = run(overlay.buildah("mount", name), check=False).returncode == 0
        run(overlay.buildah("rm", name), check=False)
        if mounted:
            return overlay
    log.info("overlay storage unavailable (%s); using vfs", probe.stderr.strip()[-200:])
    return Storage("vfs")


def base_rootfs() -> Path:
    """A tarball of Debian bookworm minbase + python3 (3.11) + venv, trimmed like a slim image."""
    tarball = CACHE / "bookworm-python3.tar"
    if tarball.exists():
        return tarball
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            timeout_s=900,
        )
        for rel in TRIM:
            for child in (rootfs / rel).glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        partial = tarball.with_suffix(".partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(rootfs, arcname=".")
        partial.rename(tarball)
    return tarball


def ensure_base(storage: Storage) -> str:
    if not storage.has_image(BASE_TAG):
        run(storage.podman("import", str(base_rootfs()), BASE_TAG))
    return BASE_TAG


def wheelhouse() -> Path:
    """build/wheelhouse, made or refreshed by the script the Makefile's `image` target uses."""
    run([str(ROOT / "docker" / "wheelhouse.sh"), str(ROOT / "build" / "wheelhouse")])
    return ROOT / "build" / "wheelhouse"


def inputs_digest(wheels: Path) -> str:
    digest = hashlib.sha256()
    for name in IMAGE_INPUTS:
        path = ROOT / name
        if not path.exists():
            continue
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in files:
            if file.is_file() and "__pycache__" not in file.parts:
                digest.update(str(file.relative_to(ROOT)).encode())
                digest.update(file.read_bytes())
    # The dependency wheels by name (the project's own wheel is covered by its sources).
    for wheel in sorted(wheels.glob("*.whl")):
        if not wheel.name.startswith("scriptserve-"):
            digest.update(wheel.name.encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class BuiltImage:
    storage: Storage
    tag: str
    build_seconds: float  # 0 when an image with the same inputs was already built


def build_image(storage: Storage) -> BuiltImage:
    """Build docker/Dockerfile on the test base (skipped when its inputs are unchanged). The
    base (debootstrap, which mostly waits on the mirror: 37 s of CPU in 644 s on a 2-core AMD
    EPYC in a whole run of the suite) and the wheelhouse (2.5 minutes there) are made at once."""
    with ThreadPoolExecutor(1) as pool:
        making_base = pool.submit(ensure_base, storage)
        wheels = wheelhouse()
        base = making_base.result()
    tag = f"{IMAGE_REPO}:{inputs_digest(wheels)}"
    if storage.has_image(tag):
        return BuiltImage(storage, tag, 0.0)
    start = time.monotonic()
    run(
        storage.buildah(
            "bud",
            "--isolation",
            "chroot",
            "--format",
            "docker",
            "--pull-never",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            f"WHEELHOUSE={wheels.relative_to(ROOT)}",
            "-f",
            str(ROOT / "docker" / "Dockerfile"),
            "-t",
            tag,
            str(ROOT),
        ),
        timeout_s=1500,
    )
    elapsed = time.monotonic() - start
    # Older test images (other inputs) only take disk space.
    listed = run(storage.buildah("images", "--format", "{{.Name}}:{{.Tag}}")).stdout.split()
    for old in listed:
        if old.startswith(f"{IMAGE_REPO}:") and old != tag:
            run(storage.buildah("rmi", "--force", old), check=False)
    run(storage.buildah("rmi", "--prune"), check=False)
    return BuiltImage(storage, tag, elapsed)


def build_default_image() -> BuiltImage:
    """The image on the storage this machine supports."""
    return build_image(pick_storage())
