"""A package compiled to compute in bfloat16 behind float32 inputs and outputs, held to the
accuracy guard against fp32. It is built through the calls model-archiver makes
(`pt2models.tiny_bf16_build`, compiled by the head start's child), since this machine's CPU may
lack bfloat16 instructions and the CLI then refuses it (tests/archiver/test_precision.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pt2models import tiny_bf16_build
from testmodels import TinyMLP

from scriptserve.archiver.accuracy import QuantizationError, Tolerance, ValidationSamples
from scriptserve.archiver.model_file import ModelFileError
from scriptserve.archiver.model_source import load_eager_model
from scriptserve.archiver.precision import check_precision, reduced
from scriptserve.archiver.pt2_check import PackageRunner, check_at_bound
from scriptserve.archiver.pt2_package import read_package


def test_a_bf16_package_computes_in_bfloat16_and_passes_the_guard() -> None:
    build, source = tiny_bf16_build()

    assert build.info.precision == "bf16"
    assert [t.datatype for t in build.signature.inputs] == ["FP32"]  # clients still send fp32
    x = np.random.default_rng(0).standard_normal((200, 8)).astype(np.float32)
    samples = ValidationSamples({"x": x})
    checked = check_precision(build.package, source, samples, Tolerance(min_top1_agreement=0.9))
    validation = checked["validation"]
    assert validation["top1_agreement"] >= 0.9 and validation["max_abs_diff"] > 0
    out = PackageRunner(build.package)({"x": x})["output0"]
    assert out.dtype == np.float32
    assert "bfloat16" in read_package(build.package).wrapper  # kernels compute in bfloat16
    with pytest.raises(QuantizationError, match="bf16/fp16 refused: max"):
        check_precision(build.package, source, samples, Tolerance(max_abs_diff=1e-9))


def test_at_its_batch_bound_a_bf16_package_is_held_to_rounding_not_to_fp32s_digits() -> None:
    """The check at the bound compares the package with the eager model in bfloat16: the two
    round differently, so the rule is a share of the outputs' norm (`REDUCED_AT_BOUND`), which
    still refuses a package that answers for another model."""
    build, source = tiny_bf16_build()
    model = reduced(load_eager_model(source.model_file, source.weights, source.model_class), "bf16")
    sample = {"x": np.full((1, 8), 0.5, dtype=np.float32)}
    bound = build.info.max_batch
    assert bound is not None and bound > 1

    check_at_bound(build.package, model, sample, bound, "cpu", reduced=True)

    wrong = TinyMLP().eval()
    with torch.no_grad():
        wrong.fc2.weight.mul_(1.2)  # answers 20 % off: a kernel that is wrong at the bound
    other = reduced(wrong, "bf16")
    with pytest.raises(ModelFileError, match="of its outputs' norm on a batch of"):
        check_at_bound(build.package, other, sample, bound, "cpu", reduced=True)
