"""The GPU image's Python layer, made on this machine the way docker/Dockerfile.gpu makes it
(`docker/wheelhouse.sh --project-only`, then `docker/gpu-layer.sh`): the wheel the CPU image
installs, with the `gpu` extra. The one difference from the image: torch is pip's own build here
(the CPU one), where the image takes the CUDA build from PyTorch's index. The CUDA base image
and that index are not reachable from the test machines; the image itself is built by
`make image-gpu` where they are."""

from __future__ import annotations

import subprocess
from pathlib import Path

import distribution
import pytest

# Slow: a fresh virtual environment (torch, ONNX Runtime's CUDA build) made in the background.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpu_layer(installed: tuple[Path, str]) -> tuple[Path, str]:
    return installed


def run(scripts: Path, code: str) -> str:
    done = subprocess.run(
        [str(scripts / "python"), "-c", code], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_layer_imports_every_part_and_offers_onnxruntimes_cuda_provider(
    gpu_layer: tuple[Path, str],
) -> None:
    scripts, printed = gpu_layer
    assert "CUDAExecutionProvider" in printed  # the script's own check, as the image runs it
    where = run(scripts, "import scriptserve.training.cli as c; print(c.__file__)")
    assert Path(where).is_relative_to(scripts.parent)  # the installed wheel, not this checkout
    found = run(
        scripts,
        "import importlib.metadata as m; "
        "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))",
    )
    assert "'onnxruntime-gpu'" in found
    assert "'onnxruntime'" not in found  # the CPU build would shadow the CUDA one
    providers = run(scripts, "import onnxruntime; print(onnxruntime.get_available_providers())")
    assert "CUDAExecutionProvider" in providers


def test_the_gpu_image_installs_the_wheel_the_layer_script_makes() -> None:
    """The Dockerfile builds through the same two scripts; a change to one shows in the other."""
    dockerfile = (distribution.REPO / "docker" / "Dockerfile.gpu").read_text()
    assert "COPY ${WHEEL_DIR}/ /wheels/" in dockerfile
    assert "gpu-layer /opt/venv /wheels" in dockerfile
    assert "COPY archiver" not in dockerfile  # no package copied by hand: the wheel has them all
    makefile = (distribution.REPO / "Makefile").read_text()
    assert "docker/wheelhouse.sh --project-only build/gpu-wheel" in makefile
