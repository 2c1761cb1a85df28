"""`scriptserve.__version__` is the one version string, and both commands print it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from testmodels import save_torchscript

import scriptserve
from scriptserve.archiver.archive import open_archive

# Slow: the CLIs run in a process per test.
pytestmark = pytest.mark.slow


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "command",
    [
        ["scriptserve", "--version"],
        ["model-archiver", "--version"],
        ["model-archiver", "--archiver-version"],
    ],
)
def test_commands_print_the_package_version(dev_scripts: Path, command: list[str]) -> None:
    done = run([str(dev_scripts / command[0]), *command[1:]])
    assert done.returncode == 0, done.stderr
    assert scriptserve.__version__ in done.stdout


def test_model_archiver_version_with_a_value_is_the_models(
    dev_scripts: Path, tmp_path: Path
) -> None:
    """TorchServe's `-v/--version VERSION` still names the model's version."""
    model = save_torchscript(tmp_path / "tiny.pt")
    done = run(
        [
            str(dev_scripts / "model-archiver"),
            "--model-name",
            "tiny",
            "--version",
            "7.5",
            "--serialized-file",
            str(model),
            "--input-shape",
            "8",
            "--export-path",
            str(tmp_path),
        ]
    )
    assert done.returncode == 0, done.stderr
    with open_archive(tmp_path / "tiny.mar") as reader:
        assert reader.manifest.model.model_version == "7.5"
