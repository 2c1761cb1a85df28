"""Dynamic int8 quantization of a model file: the one place that converts a model to int8.

Used by `model-archiver --quantize dynamic-int8` (archive time), by the server when a model is
loaded with `quantize: dynamic-int8` (load time, cached on disk by the source model's SHA-256:
archiver/quantize_cache.py), and by training/export code; the accuracy guard that compares int8
with fp32 on validation samples is archiver/accuracy.py::

    report = quantize_model_file(
        Path("model.pt"), Path("model.int8.pt"), "torchscript",
        sample_inputs={"x": np.zeros((1, 512), np.float32)},
        options=QuantizeOptions(),
    )
    report.size_ratio, report.latency_ratio, report.max_abs_diff

`quantize_model_file(src, dst, fmt, sample_inputs, options=None, validation=None,
tolerance=None) -> QuantizationReport` writes `dst` or raises `QuantizationError` (and leaves no
`dst`) when there is nothing to quantize or the accuracy guard refuses the result.

Each model format converts in its own module under archiver/int8/ (`torchscript.py`: torch.ao
dynamic quantization; `onnx.py`: onnxruntime's `quantize_dynamic`), named here in `CONVERTERS`;
this module measures the result the same way for every format and reports it. A `.pt2` package
is quantized from the model it is compiled from, at archive time only (`quantize_pt2`:
torchao's PT2E flow, dynamic or static, in `pt2.py`), and measured against the fp32 package.

Ratios are fp32 / int8: `size_ratio` 4.0 means four times smaller, `latency_ratio` 2.0 twice as
fast (medians in this process, on the sample input).
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scriptserve.archiver.accuracy import (
    QuantizationError,
    Runner,
    Tolerance,
    ValidationResult,
    ValidationSamples,
    check_tolerance,
    compare,
    max_abs_diff,
)
from scriptserve.archiver.int8 import onnx as onnx_int8
from scriptserve.archiver.int8 import pt2 as pt2_int8
from scriptserve.archiver.int8 import torchscript as torchscript_int8
from scriptserve.archiver.int8.conversion import Int8Conversion, Int8Converter, QuantizeOptions
from scriptserve.archiver.int8.torchscript import is_torchscript_file, select_engine
from scriptserve.archiver.manifest import ModelFormat, Quantization
from scriptserve.archiver.pt2_check import PackageRunner
from scriptserve.archiver.pt2_export import Pt2Source

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = [
    "ARCHIVE_MODES",
    "CONVERTERS",
    "DYNAMIC_INT8",
    "MODES",
    "STATIC_INT8",
    "QuantizationError",
    "QuantizationReport",
    "QuantizeOptions",
    "Tolerance",
    "ValidationSamples",
    "convert",
    "converter_for",
    "is_torchscript_file",
    "quantize_model_file",
    "quantize_pt2",
    "select_engine",
    "sha256_of",
]
"""The conversion API; the accuracy guard's types (archiver/accuracy.py) are part of it, and so
are TorchScript's `select_engine` and `is_torchscript_file` (archiver/int8/torchscript.py),
which the TorchScript backend and the model-archiver CLI use."""

DYNAMIC_INT8 = "dynamic-int8"
STATIC_INT8 = "static-int8"
MODES = ("none", DYNAMIC_INT8)
"""What a model config or registration may ask for at load."""
ARCHIVE_MODES = (*MODES, STATIC_INT8)
"""What `model-archiver --quantize` takes: static int8 is made at archive time, for `.pt2`."""

CONVERTERS: dict[ModelFormat, Int8Converter] = {
    "torchscript": torchscript_int8.CONVERTER,
    "onnx": onnx_int8.CONVERTER,
}
"""Dynamic int8 by model format: each converter lives in its own module under archiver/int8/."""


@dataclass(frozen=True)
class QuantizationReport:
    """What a conversion did and measured. Ratios are fp32 / int8."""

    model_format: str
    source_sha256: str
    fp32_bytes: int
    int8_bytes: int
    fp32_latency_ms: float
    int8_latency_ms: float
    max_abs_diff: float
    quantized_ops: dict[str, int]
    left_float: dict[str, int]
    engine: str | None
    options: dict[str, Any]
    validation: ValidationResult | None = None
    int8_sha256: str = ""
    cached: bool = False
    mode: str = DYNAMIC_INT8

    @property
    def size_ratio(self) -> float:
        return self.fp32_bytes / self.int8_bytes

    @property
    def latency_ratio(self) -> float:
        return self.fp32_latency_ms / self.int8_latency_ms if self.int8_latency_ms else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["size_ratio"] = round(self.size_ratio, 3)
        data["latency_ratio"] = round(self.latency_ratio, 3)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationReport:
        fields = {k: v for k, v in data.items() if k not in ("size_ratio", "latency_ratio")}
        if fields.get("validation") is not None:
            fields["validation"] = ValidationResult(**fields["validation"])
        return cls(**fields)

    def manifest_entry(self, applied_at: str) -> Quantization:
        """The manifest's record of this conversion."""
        details: dict[str, Any] = {
            "appliedAt": applied_at,
            "fp32Bytes": self.fp32_bytes,
            "int8Bytes": self.int8_bytes,
            "quantizedOps": self.quantized_ops,
            "engine": self.engine,
            "options": self.options,
        }
        if self.left_float:
            details["leftFloat"] = self.left_float
        if self.validation is not None:
            details["validation"] = asdict(self.validation)
        return Quantization(
            mode=self.mode,
            details=details,
            source_sha256=self.source_sha256,
            size_ratio=round(self.size_ratio, 3),
            latency_ratio=round(self.latency_ratio, 3),
            max_abs_diff=float(self.max_abs_diff),
        )

    def summary(self) -> str:
        return (
            f"{self.mode.replace('-', ' ')}: {self.size_ratio:.2f}x smaller, "
            f"{self.latency_ratio:.2f}x faster on the sample input, "
            f"max |int8 - fp32| {self.max_abs_diff:.4g}"
        )


def converter_for(fmt: ModelFormat) -> Int8Converter:
    """The dynamic int8 converter of a model format; QuantizationError where there is none."""
    converter = CONVERTERS.get(fmt)
    if fmt == "pt2":
        raise QuantizationError(
            "a .pt2 package is quantized when it is compiled: model-archiver --export-pt2 "
            "--quantize dynamic-int8 (or static-int8) from the model's class and state dict or "
            "an ExportedProgram; serve this one without quantize"
        )
    if converter is None:
        raise QuantizationError(
            f"dynamic int8 is not available for {fmt} models "
            f"(it is for {', '.join(CONVERTERS)}); serve it without quantize"
        )
    return converter


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def quantize_model_file(
    src: Path,
    dst: Path,
    fmt: ModelFormat,
    sample_inputs: Mapping[str, np.ndarray],
    options: QuantizeOptions | None = None,
    validation: ValidationSamples | None = None,
    tolerance: Tolerance | None = None,
) -> QuantizationReport:
    """Write the dynamic-int8 version of `src` to `dst` and measure it against fp32.

    With `validation`, the int8 model is compared with fp32 on those samples and refused
    (QuantizationError, no `dst`) when over `tolerance`."""
    options = options or QuantizeOptions()
    with _removed_on_failure(dst):
        report = convert(src, dst, fmt, sample_inputs, options, validation)
        _guard(report, tolerance)
    return report


@contextlib.contextmanager
def _removed_on_failure(dst: Path) -> Iterator[None]:
    """No int8 file is left behind by a conversion that fails or is refused."""
    try:
        yield
    except BaseException:
        dst.unlink(missing_ok=True)
        raise


def _guard(report: QuantizationReport, tolerance: Tolerance | None) -> None:
    if report.validation is not None:
        check_tolerance(report.validation, tolerance or Tolerance())


def convert(
    src: Path,
    dst: Path,
    fmt: ModelFormat,
    sample: Mapping[str, np.ndarray],
    options: QuantizeOptions,
    validation: ValidationSamples | None,
) -> QuantizationReport:
    """Write the int8 version of `src` to `dst` and measure it (sample input, and the validation
    samples when given), without applying a tolerance: `quantize_model_file` and the load-time
    cache decide what to refuse."""
    converter = converter_for(fmt)
    if not src.is_file():
        raise QuantizationError(f"model file not found: {src.name}")
    _need_sample(sample)
    done = converter.convert(src, dst, options)
    _need_quantized(done.quantized_ops, done.ops, f"dynamic int8 converts {converter.converts}")
    with converter.measuring(options):
        report = _measure(done, src, dst, sample, options.latency_runs, validation)
    return replace(report, model_format=fmt, options=options.key())


def quantize_pt2(
    source: Pt2Source | ExportedProgram,
    fp32_package: Path,
    dst: Path,
    sample: Mapping[str, np.ndarray],
    max_batch: int,
    mode: str = DYNAMIC_INT8,
    options: QuantizeOptions | None = None,
    validation: ValidationSamples | None = None,
    tolerance: Tolerance | None = None,
    max_seq_len: int | None = None,
) -> QuantizationReport:
    """Write the int8 `.pt2` package of the model `fp32_package` was compiled from (torchao's
    PT2E flow, archiver/int8/pt2.py) to `dst`, and measure it against `fp32_package` as
    `quantize_model_file` measures the other formats. `static-int8` calibrates on
    `validation`. QuantizationError (and no `dst`) when nothing is quantized, the compiled code
    runs no int8 kernels, or the accuracy guard refuses it."""
    if mode not in (DYNAMIC_INT8, STATIC_INT8):
        raise QuantizationError(f"quantize {mode!r}: use {DYNAMIC_INT8} or {STATIC_INT8}")
    options = options or QuantizeOptions()
    _need_sample(sample)
    with _removed_on_failure(dst):
        done = pt2_int8.convert(
            source,
            sample,
            dst,
            max_batch,
            static=mode == STATIC_INT8,
            validation=validation,
            reduce_range=options.reduces_range(),
            max_seq_len=max_seq_len,
        )
        _need_quantized(done.kernels, done.ops, f"PT2E int8 converts {pt2_int8.CONVERTS}")
        conversion = Int8Conversion(
            fp32=PackageRunner(fp32_package, options.threads),
            int8=PackageRunner(dst, options.threads),
            quantized_ops=done.kernels,
            left_float={},
            ops=done.ops,
            engine="onednn",
        )
        report = _measure(conversion, fp32_package, dst, sample, options.latency_runs, validation)
        report = replace(report, model_format="pt2", options=done.options, mode=mode)
        _guard(report, tolerance)
    return report


def _need_sample(sample: Mapping[str, np.ndarray]) -> None:
    if not sample:
        raise QuantizationError("quantizing needs a sample input to measure int8 against fp32")


def _need_quantized(quantized: Mapping[str, int], ops: list[str], converts: str) -> None:
    if not quantized:
        listed = ", ".join(ops[:12]) + (", ..." if len(ops) > 12 else "")
        raise QuantizationError(
            f"nothing to quantize: {converts}, and this model has none "
            f"(its ops: {listed or 'none'}); serve it in fp32 without --quantize"
        )


def _measure(
    done: Int8Conversion,
    src: Path,
    dst: Path,
    sample: Mapping[str, np.ndarray],
    latency_runs: int,
    validation: ValidationSamples | None,
) -> QuantizationReport:
    """Both versions on the sample (difference, latency) and on the validation samples."""
    try:
        diff = max_abs_diff(done.fp32(sample), done.int8(sample))
        fp32_ms, int8_ms = _latency_ms(done.fp32, done.int8, sample, latency_runs)
        checked = compare(done.fp32, done.int8, validation) if validation else None
    except QuantizationError:
        raise
    except Exception as exc:
        raise QuantizationError(f"the int8 model failed on the sample input: {exc}") from None
    return QuantizationReport(
        model_format="",
        source_sha256=sha256_of(src),
        fp32_bytes=src.stat().st_size,
        int8_bytes=dst.stat().st_size,
        fp32_latency_ms=round(fp32_ms, 5),
        int8_latency_ms=round(int8_ms, 5),
        max_abs_diff=diff,
        quantized_ops=done.quantized_ops,
        left_float=done.left_float,
        engine=done.engine,
        options={},
        validation=checked,
        int8_sha256=sha256_of(dst),
    )


def _latency_ms(
    fp32: Runner, int8: Runner, sample: Mapping[str, np.ndarray], runs: int
) -> tuple[float, float]:
    """Medians of alternating runs, after a warm-up; fewer runs for a slow model."""
    for _ in range(5):
        fp32(sample)
        int8(sample)
    started = time.perf_counter()
    fp32(sample)
    one = time.perf_counter() - started
    runs = max(3, min(runs, int(2.0 / max(one, 1e-6))))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for runner, out in ((fp32, times[0]), (int8, times[1])):
            started = time.perf_counter()
            runner(sample)
            out.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])
