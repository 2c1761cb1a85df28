"""Export a trained model: `.pt2` (torch.export + AOTInductor, fp32 and int8), TorchScript
(script, trace), ONNX and TorchScript int8, each checked on held-out data.

Every exported file is run on held-out inputs with its own runtime and compared with the eager
model; a file whose outputs differ by more than its tolerance is refused (`ExportError`).

| format | runtime | tolerance vs eager fp32 (max abs difference of the logits) |
| --- | --- | --- |
| pt2 | the AOTInductor C ABI (archiver.pt2_check) | 1e-4 |
| pt2-int8 | the same; torchao PT2E via archiver.quantize | the guard on the validation samples |
| torchscript (script) | torch.jit | 1e-4 |
| traced | torch.jit | 1e-4, and script vs trace agree to 1e-5 |
| onnx | onnxruntime (CPU) | 1e-3 |
| torchscript-int8 | archiver.quantize | the guard on the validation samples |

The guard: top-1 agreement with fp32 >= 0.98 and accuracy within 1 point. A run with QAT makes
its pt2-int8 package in training/qat.py instead, guarded against the fake-quantized model it
trained. TorchScript is deprecated upstream (torch.export replaces it); `torch.jit` and the
TorchScript-based ONNX exporter print deprecation warnings on torch 2.13, filtered here around
each of those calls and nowhere on the `.pt2` path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from scriptserve.archiver.manifest import Pt2Info
from scriptserve.archiver.model_file import ModelFileError, import_onnxruntime
from scriptserve.archiver.pt2_check import PackageRunner, check_package
from scriptserve.archiver.pt2_export import compile_options, compile_package, export_model
from scriptserve.archiver.quantize import (
    DYNAMIC_INT8,
    QuantizationError,
    ValidationSamples,
    quantize_model_file,
    quantize_pt2,
)

if TYPE_CHECKING:
    from torch.export import ExportedProgram

TORCHSCRIPT_ATOL = 1e-4
SCRIPT_VS_TRACE_ATOL = 1e-5
ONNX_ATOL = 1e-3
INPUT_NAME = "x"
OUTPUT_NAME = "output0"
PT2_ATOL = 1e-4
PT2_MAX_BATCH = 256
"""Largest batch the `.pt2` packages take: the default of model-archiver --export-pt2."""
FORMATS = ("pt2", "pt2-int8", "torchscript", "traced", "onnx", "torchscript-int8")
DEFAULT_FORMATS = ("pt2", "pt2-int8")


class ExportError(RuntimeError):
    """An export that failed or does not match the eager model; the message says how."""


@dataclass(frozen=True)
class Exported:
    """One exported model file, what runs it, and how far it is from the eager model."""

    fmt: str
    path: Path
    model_format: str  # archiver's: "pt2", "torchscript" or "onnx"
    max_abs_diff: float
    quantization: Any = None  # archiver.manifest.Quantization for int8
    pt2: Pt2Info | None = None
    """How a `.pt2` package was compiled, for its manifest."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Figures for the archive's `metrics` besides the test accuracy (QAT: its PTQ baseline)."""


def eager_logits(model: nn.Module, inputs: torch.Tensor) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(inputs)
    return out.float().numpy()


def run_torchscript(path: Path, inputs: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    module.eval()
    with torch.no_grad():
        out: torch.Tensor = module(torch.from_numpy(inputs))
    return out.numpy()


def run_onnx(path: Path, inputs: np.ndarray) -> np.ndarray:
    ort = import_onnxruntime()

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    (out,) = session.run([OUTPUT_NAME], {INPUT_NAME: np.ascontiguousarray(inputs)})
    return np.asarray(out)


def run_pt2(path: Path, inputs: np.ndarray) -> np.ndarray:
    """The package's logits for `inputs`, in batches it takes."""
    runner = PackageRunner(path)
    try:
        parts = [
            runner({INPUT_NAME: inputs[i : i + PT2_MAX_BATCH]})[runner.outputs[0]]
            for i in range(0, len(inputs), PT2_MAX_BATCH)
        ]
    finally:
        runner.close()
    return np.concatenate(parts)


def runner_for(model_format: str) -> Callable[[Path, np.ndarray], np.ndarray]:
    return {"onnx": run_onnx, "pt2": run_pt2}.get(model_format, run_torchscript)


def _check(fmt: str, got: np.ndarray, want: np.ndarray, atol: float) -> float:
    diff = float(np.abs(got - want).max())
    if not diff <= atol:
        raise ExportError(
            f"the {fmt} export differs from the eager model by {diff:.3g} "
            f"(more than the tolerance {atol:g}) on held-out inputs"
        )
    return diff


def export_pt2(
    model: nn.Module, path: Path, example: torch.Tensor, held_out: torch.Tensor
) -> tuple[Exported, ExportedProgram]:
    """torch.export with a dynamic batch of 1 to PT2_MAX_BATCH, compiled by AOTInductor into
    the package `path`, run through the C ABI the server uses and checked against eager. The
    program is returned too: the int8 package is made from it."""
    model.eval()
    sample = {INPUT_NAME: example.numpy()}
    try:
        program = export_model(model, sample, PT2_MAX_BATCH)
        options = compile_options()
        compile_package(program, path, options)
        options = {**options, "noGrad": True}
        build = check_package(path, sample, None, "eager", options, exported_bound=PT2_MAX_BATCH)
    except ModelFileError as exc:
        raise ExportError(f"the .pt2 export failed: {exc}") from None
    want = eager_logits(model, held_out)
    diff = _check(".pt2", run_pt2(path, held_out.numpy()), want, PT2_ATOL)
    return Exported("pt2", path, "pt2", diff, pt2=build.info), program


def export_pt2_int8(
    program: ExportedProgram,
    fp32: Exported,
    folder: Path,
    sample: np.ndarray,
    validation_inputs: np.ndarray,
    validation_labels: np.ndarray,
) -> Exported:
    """Dynamic int8 `.pt2` through torchao's PT2E flow (archiver.quantize.quantize_pt2), made
    from the program `fp32` was compiled from and measured against it; its accuracy guard
    refuses a model that drifts too far on the validation samples (ExportError)."""
    dst = folder / "model.int8.pt2"
    validation = ValidationSamples(inputs={INPUT_NAME: validation_inputs}, labels=validation_labels)
    inputs = {INPUT_NAME: sample}
    try:
        report = quantize_pt2(
            program, fp32.path, dst, inputs, PT2_MAX_BATCH, DYNAMIC_INT8, validation=validation
        )
        build = check_package(dst, inputs, None, "eager", exported_bound=PT2_MAX_BATCH)
    except (QuantizationError, ModelFileError) as exc:
        raise ExportError(f"int8 .pt2 export refused: {exc}") from None
    info = replace(build.info, compile_options=report.options.get("compileOptions", {}))
    checked = report.validation
    diff = checked.max_abs_diff if checked is not None else report.max_abs_diff
    entry = report.manifest_entry("archive")
    return Exported("pt2-int8", dst, "pt2", float(diff), entry, pt2=info)


def export_torchscript(model: nn.Module, path: Path, held_out: torch.Tensor) -> Exported:
    """`torch.jit.script`, saved and reloaded, checked against eager."""
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(model)
        torch.jit.save(scripted, str(path))
    want = eager_logits(model, held_out)
    diff = _check("TorchScript", run_torchscript(path, held_out.numpy()), want, TORCHSCRIPT_ATOL)
    return Exported("torchscript", path, "torchscript", diff)


def export_traced(
    model: nn.Module, path: Path, example: torch.Tensor, held_out: torch.Tensor
) -> Exported:
    """`torch.jit.trace` on `example`; it must agree with `script` on other (held-out) inputs."""
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, example)  # type: ignore[no-untyped-call]
        scripted = torch.jit.script(model)
        torch.jit.save(traced, str(path))
        with torch.no_grad():
            by_script = scripted(held_out).numpy()
    by_trace = run_torchscript(path, held_out.numpy())
    _check("traced (vs scripted)", by_trace, by_script, SCRIPT_VS_TRACE_ATOL)
    diff = _check("traced TorchScript", by_trace, eager_logits(model, held_out), TORCHSCRIPT_ATOL)
    return Exported("traced", path, "torchscript", diff)


def export_onnx(
    model: nn.Module, path: Path, example: torch.Tensor, held_out: torch.Tensor
) -> Exported:
    """ONNX with a dynamic batch axis, checked in onnxruntime on a batch of another size."""
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(
            model,
            (example,),
            str(path),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    if held_out.shape[0] == example.shape[0]:
        raise ExportError("check the ONNX export on a batch size other than the example's")
    diff = _check(
        "ONNX", run_onnx(path, held_out.numpy()), eager_logits(model, held_out), ONNX_ATOL
    )
    return Exported("onnx", path, "onnx", diff)


def export_torchscript_int8(
    model: nn.Module,
    folder: Path,
    sample: np.ndarray,
    validation_inputs: np.ndarray,
    validation_labels: np.ndarray,
) -> Exported:
    """Dynamic int8 (Linear layers) of the scripted model through archiver.quantize.

    Its accuracy guard compares int8 with fp32 on the validation samples and refuses a model
    that drifts too far (ExportError).
    """
    fp32 = folder / "int8-source.pt"
    export_torchscript(model, fp32, torch.from_numpy(validation_inputs))
    dst = folder / "model.int8.pt"
    validation = ValidationSamples(inputs={INPUT_NAME: validation_inputs}, labels=validation_labels)
    try:
        report = quantize_model_file(
            fp32, dst, "torchscript", {INPUT_NAME: sample}, validation=validation
        )
    except QuantizationError as exc:
        raise ExportError(f"int8 export refused: {exc}") from None
    checked = report.validation
    diff = checked.max_abs_diff if checked is not None else report.max_abs_diff
    entry = report.manifest_entry("archive")
    return Exported("torchscript-int8", dst, "torchscript", float(diff), entry)
