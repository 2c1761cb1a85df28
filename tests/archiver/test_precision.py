"""`--precision bf16|fp16`: refused where the CPU would emulate bfloat16, the ISA recorded, and
the reduced model that is exported. The package that computes in bfloat16 is
tests/archiver/test_precision_package.py's (built through model-archiver's own calls, since this
machine's CPU may lack bfloat16 instructions; where it has them, the CLI test here builds it
too)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from pt2models import TESTS, TINY_MAX_BATCH, inductor_cache, tiny_bf16_build
from testmodels import TinyMLP

from scriptserve.archiver.archive import open_archive
from scriptserve.archiver.precision import (
    precision_isa,
    precision_problem,
    reduced,
)

AVX2 = ("avx", "avx2", "fma3")


@pytest.mark.parametrize(
    ("precision", "features", "problem"),
    [
        ("fp32", AVX2, None),
        ("bf16", (*AVX2, "avx512_f", "avx512_bf16"), None),
        ("bf16", (*AVX2, "amx_int8", "amx_bf16"), None),
        ("bf16", AVX2, "needs a CPU with AVX512-BF16 or AMX"),
        ("bf16", (*AVX2, "avx512_f", "avx512_vnni"), "needs a CPU with AVX512-BF16 or AMX"),
        ("fp16", (*AVX2, "amx_bf16"), "fp16 is for GPUs"),
    ],
)
def test_bf16_needs_the_cpus_bfloat16_instructions(
    precision: str, features: tuple[str, ...], problem: str | None
) -> None:
    found = precision_problem(precision, "cpu", features)
    assert (found is None) if problem is None else (problem in (found or ""))


def test_the_isa_recorded_is_the_best_bfloat16_one() -> None:
    assert precision_isa((*AVX2, "avx512_bf16", "amx_bf16")) == "AMX-BF16"
    assert precision_isa((*AVX2, "avx512_bf16")) == "AVX512-BF16"
    assert precision_isa(AVX2) is None


def test_the_reduced_model_keeps_its_signature_and_float32_at_its_edges() -> None:
    model = reduced(TinyMLP().eval(), "bf16")
    x = torch.randn(4, 8)

    out = model(x=x)

    assert out.dtype == torch.float32
    assert list(__import__("inspect").signature(model.forward).parameters) == ["x"]
    torch.testing.assert_close(out, TinyMLP().eval()(x), atol=0.05, rtol=0.05)


def test_model_archiver_builds_bf16_only_where_the_cpu_has_it(tmp_path: Path) -> None:
    if precision_isa() is not None:
        # The same graph as the session's bf16 build (the head start's): compiled from the
        # Inductor cache it filled, not from nothing.
        tiny_bf16_build()
    torch.save(TinyMLP().state_dict(), tmp_path / "weights.pt")
    (tmp_path / "sample.json").write_text(json.dumps([0.5] * 8))
    with inductor_cache():
        done = subprocess.run(
            [
                "model-archiver",
                "--model-name",
                "m",
                "--version",
                "1",
                "--export-pt2",
                "--model-file",
                str(TESTS / "testmodels.py"),
                "--model-class",
                "TinyMLP",
                "--serialized-file",
                str(tmp_path / "weights.pt"),
                "--sample-input",
                str(tmp_path / "sample.json"),
                "--precision",
                "bf16",
                "--max-batch",
                str(TINY_MAX_BATCH),
                "--min-top1-agreement",
                "0",
                "--export-path",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    assert "Traceback" not in done.stderr
    if precision_isa() is None:  # this CPU would emulate bfloat16: refused, with what to do
        assert done.returncode == 1
        assert "--precision bf16 needs a CPU with AVX512-BF16 or AMX" in done.stderr
        assert not (tmp_path / "m.mar").exists()
        return
    assert done.returncode == 0, done.stderr
    with open_archive(tmp_path / "m.mar") as reader:
        pt2 = reader.manifest.scriptserve.pt2  # type: ignore[union-attr]
    assert pt2 is not None and pt2.precision == "bf16"
    assert pt2.precision_check["isa"] in ("AMX-BF16", "AVX512-BF16")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_gpu_package_in_half_precision_passes_the_guard(tmp_path: Path, precision: str) -> None:
    torch.save(TinyMLP().state_dict(), tmp_path / "weights.pt")
    (tmp_path / "sample.json").write_text(json.dumps([0.5] * 8))
    with inductor_cache():
        done = subprocess.run(
            [
                "model-archiver",
                "--model-name",
                "m",
                "--version",
                "1",
                "--export-pt2",
                "--model-file",
                str(TESTS / "testmodels.py"),
                "--model-class",
                "TinyMLP",
                "--serialized-file",
                str(tmp_path / "weights.pt"),
                "--pt2-device",
                "cuda",
                "--sample-input",
                str(tmp_path / "sample.json"),
                "--precision",
                precision,
                "--min-top1-agreement",
                "0",
                "--export-path",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    assert done.returncode == 0, done.stderr
    with open_archive(tmp_path / "m.mar") as reader:
        pt2 = reader.manifest.scriptserve.pt2  # type: ignore[union-attr]
    assert pt2 is not None and pt2.precision == precision
    assert pt2.target.device == "cuda"
