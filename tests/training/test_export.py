"""Exports match the eager model; the archives verify and record what the server needs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from scriptserve.archiver.archive import open_archive, verify_archive
from scriptserve.training import data
from scriptserve.training.checkpoint import load_checkpoint
from scriptserve.training.export import (
    ONNX_ATOL,
    PT2_ATOL,
    TORCHSCRIPT_ATOL,
    ExportError,
    export_onnx,
    export_traced,
    run_onnx,
    run_pt2,
    run_torchscript,
)
from scriptserve.training.models import Net
from scriptserve.training.run import TrainConfig, TrainResult

Trained = tuple[TrainConfig, TrainResult]


def eager(config: TrainConfig) -> Net:
    net = Net()
    net.load_state_dict(load_checkpoint(config.run_dir / "checkpoints" / "last.pt")["model"])
    return net.eval()


@pytest.fixture(scope="module")
def test_inputs() -> tuple[np.ndarray, np.ndarray]:
    split = data.load_splits(0).test
    return split.images.numpy(), split.labels.numpy()


RUNNERS = {
    "pt2": run_pt2,
    "torchscript": run_torchscript,
    "traced": run_torchscript,
    "onnx": run_onnx,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "archive", "atol"),
    [("pt2", "digits.mar", PT2_ATOL), ("torchscript", "digits-torchscript.mar", TORCHSCRIPT_ATOL),
     ("traced", "digits-traced.mar", TORCHSCRIPT_ATOL), ("onnx", "digits-onnx.mar", ONNX_ATOL)],
)  # fmt: skip
def test_exported_model_matches_eager(
    trained: Trained,
    test_inputs: tuple[np.ndarray, np.ndarray],
    fmt: str,
    archive: str,
    atol: float,
) -> None:
    config, result = trained
    inputs, labels = test_inputs
    with torch.no_grad():
        want = eager(config)(torch.from_numpy(inputs)).numpy()
    with open_archive(config.out / archive) as reader:
        model_file = reader.path(reader.manifest.model.serialized_file or "")
        run = RUNNERS[fmt]
        for batch in (inputs[:1], inputs[:7], inputs):  # the batch axis is dynamic
            got = run(model_file, batch)
            np.testing.assert_allclose(got, want[: len(batch)], rtol=0, atol=atol)
        accuracy = float((run(model_file, inputs).argmax(1) == labels).mean())
        metrics = reader.manifest.scriptserve.metrics  # type: ignore[union-attr]
    assert metrics["testAccuracy"] == pytest.approx(accuracy)
    assert result.metrics["exports"][fmt]["testAccuracy"] == pytest.approx(accuracy)


@pytest.mark.slow
def test_archives_verify_and_record_signature_samples_and_accuracy(trained: Trained) -> None:
    _, result = trained
    assert sorted(p.name for p in result.archives) == [
        "digits-int8.mar",
        "digits-onnx.mar",
        "digits-torchscript-int8.mar",
        "digits-torchscript.mar",
        "digits-traced.mar",
        "digits.mar",
    ]
    for path in result.archives:
        report = verify_archive(path)
        assert report.ok, report.reason()
        with open_archive(path) as reader:
            manifest = reader.manifest
            info = manifest.scriptserve
            assert info is not None
            assert manifest.model.handler == "image_classifier"
            (spec,) = info.signature.inputs
            assert (spec.name, spec.datatype, spec.shape) == ("x", "FP32", (-1, 1, 32, 32))
            assert info.signature.outputs[0].shape == (-1, 10)
            assert info.metrics["testAccuracy"] >= 0.9 and info.metrics["testSamples"] == 270
            sample = json.loads(reader.path(info.sample_input or "").read_text())
            assert np.asarray(sample).shape == (1, 32, 32)
            with np.load(reader.path(info.validation_samples or ""), allow_pickle=False) as val:
                assert val["x"].shape == (270, 1, 32, 32) and val["labels"].shape == (
                    270,
                )  # the test split
            names = json.loads(reader.path("index_to_name.json").read_text())
            assert names == {str(d): str(d) for d in range(10)}
            pre = json.loads(reader.path("preprocessing.json").read_text())
            assert pre["resize"] == [32, 32] and pre["grayscale"] is True


class Branchy(nn.Module):
    """Data-dependent control flow: tracing freezes one branch, scripting keeps both."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 0):
            return x.flatten(1)[:, :10] * 2
        return x.flatten(1)[:, :10] + 1


def test_trace_that_disagrees_with_script_is_refused(tmp_path: Path) -> None:
    example = torch.ones(2, 1, 32, 32)
    held_out = -torch.ones(5, 1, 32, 32)  # takes the branch the trace did not see
    with (
        pytest.warns(torch.jit.TracerWarning),
        pytest.raises(ExportError, match="traced \\(vs scripted\\) export differs"),
    ):
        export_traced(Branchy(), tmp_path / "traced.pt", example, held_out)


def test_onnx_check_needs_another_batch_size(tmp_path: Path) -> None:
    example = torch.zeros(4, 1, 32, 32)
    with pytest.raises(ExportError, match="batch size other than the example's"):
        export_onnx(Net().eval(), tmp_path / "m.onnx", example, torch.zeros(4, 1, 32, 32))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("archive", "kernels"),
    [("digits-int8.mar", {"aoti_torch_cpu__qlinear_pointwise_tensor": 3}),
     ("digits-torchscript-int8.mar", {"quantized::linear_dynamic": 3})],
)  # fmt: skip
def test_int8_agrees_with_eager_and_records_its_guard(
    trained: Trained,
    test_inputs: tuple[np.ndarray, np.ndarray],
    archive: str,
    kernels: dict[str, int],
) -> None:
    """Both int8 archives convert the net's three Linear layers; the `.pt2` one runs them as
    oneDNN's fused int8 kernels."""
    config, result = trained
    inputs, labels = test_inputs
    with torch.no_grad():
        want = eager(config)(torch.from_numpy(inputs)).numpy()
    with open_archive(config.out / archive) as reader:
        info = reader.manifest.scriptserve
        assert info is not None
        run = run_pt2 if reader.manifest.model_format == "pt2" else run_torchscript
        got = run(reader.path(reader.manifest.model.serialized_file or ""), inputs)
    assert info.quantization.mode == "dynamic-int8"
    assert info.quantization.details["quantizedOps"] == kernels
    assert info.quantization.details["validation"]["samples"] == 270  # the test split
    agreement = float((got.argmax(1) == want.argmax(1)).mean())
    assert agreement >= 0.98  # the int8 tolerance documented in training/export.py
    int8_accuracy = float((got.argmax(1) == labels).mean())
    assert int8_accuracy >= result.metrics["test_accuracy"] - 0.02
    assert info.metrics["testAccuracy"] == pytest.approx(int8_accuracy)
