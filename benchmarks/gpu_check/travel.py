"""What travels to the GPU machine beside the working tree (cp312 wheels, at most `LIMIT_BYTES`),
made here with `--prepare`, and how it is installed there (`pip_install`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

LIMIT_BYTES = 64 * 2**20
"""What may travel to the GPU machine with the working tree."""
TRAVEL = [
    # serving (scriptserve's own dependencies but torch, torchao, onnx, tokenizers)
    "numpy>=1.26", "pyyaml>=6.0", "orjson>=3.9", "pysimdjson>=6.0", "fastapi>=0.115",
    "uvicorn>=0.30", "httptools>=0.6", "uvloop>=0.19", "pydantic>=2.7", "pydantic-settings>=2.4",
    "prometheus-client>=0.20", "python-multipart>=0.0.9", "grpcio>=1.85.1", "protobuf>=7.35.1",
    "grpcio-health-checking>=1.85.1", "grpcio-reflection>=1.85.1",
    "googleapis-common-protos>=1.63", "pillow>=10.0", "filelock>=3.12", "httpx>=0.27",
    # the check itself and the gpu-marked tests; setuptools builds scriptserve there
    "pytest>=8", "pytest-timeout>=2.3", "psutil>=5.9", "setuptools>=77",
]  # fmt: skip
"""Requirements whose cp312 wheels travel (with their own dependencies). torch and onnxruntime
are the machine's; torchao (int8), onnx (ONNX export) and tokenizers (text handlers) are left
out for room: the steps that need them say so."""


def pip_install(command: list[str], args: list[str]) -> None:
    """Run pip; where the Python is the distribution's (PEP 668: "externally managed"), again
    with --break-system-packages: a GPU machine used for this check is set up for it alone."""

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=300)

    done = run([*command, *args])
    if done.returncode != 0 and "externally-managed-environment" in done.stderr:
        done = run([*command, "--break-system-packages", *args])
    if done.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def prepare(out: Path, python: str = "3.12") -> int:
    """The wheels that travel to the GPU machine: TRAVEL's, for `python` (scriptserve's own is
    built there, from the tree that travels with them)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "-d",
            str(out),
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--abi",
            f"cp{python.replace('.', '')}",
            "--platform",
            "manylinux_2_28_x86_64",
            "--platform",
            "manylinux2014_x86_64",
            "--platform",
            "manylinux_2_17_x86_64",
            "--platform",
            "any",
            *TRAVEL,
        ],
        check=True,
    )
    size = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {out}")
    if size > LIMIT_BYTES:
        print(f"more than the {LIMIT_BYTES / 2**20:.0f} MiB that may travel", file=sys.stderr)
        return 1
    return 0
