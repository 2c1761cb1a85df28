"""What the gpu check runs, on what, and within which bounds: the tree it runs from and where it
works, the `gpu`-marked tests, the MLP's size and batches, and how near the CPU's answers a
GPU's must be."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "gpu-check"
RESULTS = REPO / "benchmarks" / "results"
GPU_TESTS: dict[str, tuple[str, ...]] = {
    "tests/handlers/test_backends.py": (),
    "tests/handlers/test_pt2_backend.py": (),
    "tests/archiver/test_precision.py": (),
    "tests/server/test_gauges.py": (),
    "tests/training/test_fsdp.py": ("sklearn", "matplotlib"),
}
"""The files holding `gpu`-marked tests (tests/packaging/test_gpu_check.py keeps this true), with
the modules each needs beyond what travels: a file whose modules are missing is listed as not
run, with them named (the training tests need the `train` extra: SciPy and scikit-learn alone
are larger than what may travel)."""
BATCHES = (1, 8, 64)
FEATURES, HIDDEN, CLASSES = 512, 2048, 16
TOLERANCE = 2e-3
"""Largest difference allowed between an answer and the CPU's (TF32 and kernel choice on GPUs)."""
