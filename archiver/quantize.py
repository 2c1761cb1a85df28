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

- TorchScript: `Linear` weights become qint8 with activations quantized per batch at run time.
  A scripted file goes through `torch.ao.quantization.quantize_dynamic_jit` (Linear only: its
  LSTM/GRU stay fp32 and the report names them). An eager model (`options.model_file`, a
  Python file with the `nn.Module` class, and `src` its state dict, read with
  `weights_only=True`) goes through `torch.ao.quantization.quantize_dynamic` (Linear, LSTM,
  GRU) and is then scripted.
- ONNX: `onnxruntime.quantization.quantize_dynamic` on MatMul/Gemm/Attention/LSTM (Conv is left
  out by default: ONNX Runtime's ConvInteger is rarely faster on CPUs).
- The torch quantized engine is `x86` on x86-64 (fbgemm kernels, plus oneDNN where it is faster;
  dynamic Linear uses fbgemm with reduce_range, which is right for CPUs without VNNI too),
  `fbgemm` on builds without `x86`, and `qnnpack` on ARM. `select_engine` sets it.

Ratios are fp32 / int8: `size_ratio` 4.0 means four times smaller, `latency_ratio` 2.0 twice as
fast (medians in this process, on the sample input). torch.jit and torch.ao.quantization warn
that they are deprecated on torch 2.13; those warnings are filtered here, around each call.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import logging
import platform
import statistics
import sys
import threading
import time
import warnings
import zipfile
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
from scriptserve.archiver.manifest import ModelFormat, Quantization

log = logging.getLogger("scriptserve.quantize")

__all__ = [
    "DYNAMIC_INT8",
    "MODES",
    "QuantizationError",
    "QuantizationReport",
    "QuantizeOptions",
    "Tolerance",
    "ValidationSamples",
    "convert",
    "is_torchscript_file",
    "quantize_model_file",
    "select_engine",
    "sha256_of",
]
"""The conversion API; the accuracy guard's types (archiver/accuracy.py) are part of it."""

DYNAMIC_INT8 = "dynamic-int8"
MODES = ("none", DYNAMIC_INT8)
ONNX_OP_TYPES = ("MatMul", "Gemm", "Attention", "LSTM")
_ONNX_INT8_OPS = {"MatMulInteger", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM", "QAttention",
                  "ConvInteger", "QGemm"}  # fmt: skip
_TORCH_FLOAT_OPS = {"aten::linear": "Linear", "aten::lstm": "LSTM", "aten::gru": "GRU"}


@dataclass(frozen=True)
class QuantizeOptions:
    """How to quantize. The defaults suit x86-64 CPUs."""

    weight_type: str = "qint8"
    """ONNX weight type, `qint8` or `quint8` (TorchScript weights are always qint8)."""
    per_channel: bool = False
    """One scale per output channel of each weight instead of one per tensor."""
    reduce_range: bool = False
    """ONNX: 7-bit weights, for CPUs without VNNI (TorchScript's fbgemm kernels already do it)."""
    op_types: tuple[str, ...] = ONNX_OP_TYPES
    """ONNX node types to quantize; add "Conv" to try ConvInteger."""
    engine: str | None = None
    """torch quantized engine; None picks the right one for this machine."""
    model_file: Path | None = None
    """Eager TorchScript source: the Python file defining the model; `src` is its state dict."""
    model_class: str | None = None
    """The class in `model_file`, when it defines more than one `nn.Module`."""
    latency_runs: int = 20
    threads: int = 1
    """Intra-op threads while measuring latency (the server passes its per-worker count)."""

    def key(self) -> dict[str, Any]:
        """What changes the int8 file (the cache key), as JSON-able values."""
        return {
            "weightType": self.weight_type,
            "perChannel": self.per_channel,
            "reduceRange": self.reduce_range,
            "opTypes": list(self.op_types),
            "engine": self.engine,
        }


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
            mode=DYNAMIC_INT8,
            details=details,
            source_sha256=self.source_sha256,
            size_ratio=round(self.size_ratio, 3),
            latency_ratio=round(self.latency_ratio, 3),
            max_abs_diff=float(self.max_abs_diff),
        )

    def summary(self) -> str:
        return (
            f"dynamic int8: {self.size_ratio:.2f}x smaller, {self.latency_ratio:.2f}x faster "
            f"on the sample input, max |int8 - fp32| {self.max_abs_diff:.4g}"
        )


# -- torch helpers ---------------------------------------------------------------------------
_engine_lock = threading.Lock()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.jit / torch.ao.quantization deprecation warnings, for the calls inside only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message=".*deprecated.*", category=UserWarning)
        # quantize_dynamic_jit reads .grad of the scripted module's parameters.
        warnings.filterwarnings("ignore", message=".*\\.grad attribute.*", category=UserWarning)
        yield


def select_engine(engine: str | None = None) -> str:
    """Set torch's quantized engine (`x86` on x86-64, `qnnpack` on ARM) and return it."""
    import torch

    supported = list(torch.backends.quantized.supported_engines)
    if engine is None:
        x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
        preferred = ("x86", "fbgemm") if x86 else ("qnnpack",)
        engine = next((e for e in preferred if e in supported), None)
        if engine is None:
            raise QuantizationError(
                f"this torch build has no quantized engine for {platform.machine()} "
                f"(it has {', '.join(supported)})"
            )
    elif engine not in supported:
        raise QuantizationError(
            f"quantized engine {engine!r} is not in this torch build ({', '.join(supported)})"
        )
    with _engine_lock:
        if torch.backends.quantized.engine != engine:
            torch.backends.quantized.engine = engine
    return engine


def is_torchscript_file(path: Path) -> bool:
    """A file written by torch.jit.save (a zip with a code/ folder), not a torch.save one."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any("/code/" in n for n in zf.namelist())


def _torch_runner(module: Any) -> Runner:
    import torch

    names = [a.name for a in module.forward.schema.arguments[1:]]

    def run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from scriptserve.archiver.model_file import name_torchscript_outputs

        values = list(inputs.values()) if set(inputs) != set(names) else [inputs[n] for n in names]
        with torch.inference_mode():
            out = module(*(torch.from_numpy(np.ascontiguousarray(v)) for v in values))
        return {k: v.detach().numpy() for k, v in name_torchscript_outputs(out).items()}

    return run


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads for a measurement; a server passes the count it already uses."""
    import torch

    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _op_counts(module: Any) -> Counter[str]:
    counts: Counter[str] = Counter()

    def walk(block: Any) -> None:
        for node in block.nodes():
            counts[node.kind()] += 1
            for inner in node.blocks():
                walk(inner)

    walk(module.inlined_graph)
    return counts


def _load_eager(model_file: Path, weights: Path, class_name: str | None) -> Any:
    import torch

    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"scriptserve_eager_{digest}", model_file)
    if spec is None or spec.loader is None:
        raise QuantizationError(f"model file {model_file.name!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(model_file.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise QuantizationError(f"model file {model_file.name!r} failed: {exc!r}") from None
    finally:
        sys.path.remove(str(model_file.parent))
    classes = {
        n: c
        for n, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, torch.nn.Module) and c.__module__ == module.__name__
    }
    if class_name is not None and class_name not in classes:
        raise QuantizationError(f"{model_file.name} defines no nn.Module named {class_name!r}")
    if class_name is None and len(classes) != 1:
        raise QuantizationError(
            f"{model_file.name} defines {len(classes)} nn.Module classes "
            f"({', '.join(classes) or 'none'}); name the one to use"
        )
    model = classes[class_name or next(iter(classes))]()
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        model.load_state_dict(state)
    except Exception as exc:
        raise QuantizationError(
            f"the weights in {weights.name!r} do not fit {type(model).__name__}: {exc}"
        ) from None
    return model.eval()


def _quantize_torchscript(src: Path, dst: Path, options: QuantizeOptions) -> tuple[Any, Any, str]:
    """(fp32 scripted module, int8 scripted module, engine); the int8 one is saved to dst."""
    import torch
    from torch.ao import quantization as tq

    engine = select_engine(options.engine)
    with _quiet():
        if options.model_file is not None and not is_torchscript_file(src):
            eager = _load_eager(options.model_file, src, options.model_class)
            kinds = {torch.nn.Linear, torch.nn.LSTM, torch.nn.GRU}
            present = {type(m) for m in eager.modules()} & kinds
            spec: dict[Any, Any] = {
                k: tq.per_channel_dynamic_qconfig
                if options.per_channel and k is torch.nn.Linear
                else tq.default_dynamic_qconfig
                for k in present
            }
            quantized = (
                tq.quantize_dynamic(eager, spec, dtype=torch.qint8)  # type: ignore[no-untyped-call]
                if spec
                else eager
            )
            try:
                fp32 = torch.jit.script(eager)
                int8 = torch.jit.script(quantized)
            except Exception as exc:
                raise QuantizationError(
                    f"the model does not script ({exc}); make it TorchScript-compatible"
                ) from None
        else:
            try:
                fp32 = torch.jit.load(str(src), map_location="cpu").eval()  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise QuantizationError(f"the file does not load as TorchScript: {exc}") from None
            qconfig = tq.per_channel_dynamic_qconfig if options.per_channel else (
                tq.default_dynamic_qconfig
            )  # fmt: skip
            source = torch.jit.load(str(src), map_location="cpu").eval()  # type: ignore[no-untyped-call]
            try:
                int8 = tq.quantize_dynamic_jit(source, {"": qconfig})  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise QuantizationError(f"quantize_dynamic_jit failed: {exc}") from None
        int8.save(str(dst))
        int8 = torch.jit.load(str(dst), map_location="cpu").eval()  # type: ignore[no-untyped-call]
    return fp32, int8, engine


def _torch_ops(int8: Any) -> tuple[dict[str, int], dict[str, int], list[str]]:
    counts = _op_counts(int8)
    quantized = {k: v for k, v in sorted(counts.items()) if "quantized" in k.split("::")[-1]
                 or k.startswith("quantized::")}  # fmt: skip
    left = {_TORCH_FLOAT_OPS[k]: v for k, v in counts.items() if k in _TORCH_FLOAT_OPS}
    seen = sorted(k for k in counts if k.startswith("aten::") and not k.startswith("aten::_"))
    return quantized, left, seen


# -- ONNX helpers ----------------------------------------------------------------------------
def _onnx_runner(path: Path, threads: int) -> Runner:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]

    def run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = list(inputs.values()) if set(inputs) != set(names) else [inputs[n] for n in names]
        feed = {n: np.ascontiguousarray(v) for n, v in zip(names, values, strict=True)}
        return dict(zip(outputs, session.run(None, feed), strict=True))

    return run


class _RootWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def _quantize_onnx(
    src: Path, dst: Path, options: QuantizeOptions
) -> tuple[dict[str, int], list[str]]:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    types = {"qint8": QuantType.QInt8, "quint8": QuantType.QUInt8}
    if options.weight_type not in types:
        raise QuantizationError(f"weight type {options.weight_type!r}: use qint8 or quint8")
    hint = _RootWarningFilter()  # ONNX Runtime suggests its pre-processing on the root logger
    logging.getLogger().addFilter(hint)
    try:
        quantize_dynamic(
            src, dst, weight_type=types[options.weight_type], per_channel=options.per_channel,
            reduce_range=options.reduce_range, op_types_to_quantize=list(options.op_types),
        )  # fmt: skip
    except Exception as exc:  # onnxruntime.quantization raises many unrelated types
        raise QuantizationError(f"onnxruntime quantize_dynamic failed: {exc}") from None
    finally:
        logging.getLogger().removeFilter(hint)
    nodes = Counter(n.op_type for n in onnx.load(str(dst), load_external_data=False).graph.node)
    quantized = {k: v for k, v in sorted(nodes.items()) if k in _ONNX_INT8_OPS}
    return quantized, sorted(nodes)


# -- measuring -------------------------------------------------------------------------------
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


# -- the public entry points -----------------------------------------------------------------
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _nothing_to_quantize(fmt: ModelFormat, seen: list[str]) -> QuantizationError:
    what = (
        "Linear layers (and LSTM/GRU from an eager model)"
        if fmt == "torchscript"
        else f"{', '.join(ONNX_OP_TYPES)} nodes"
    )
    ops = ", ".join(seen[:12]) + (", ..." if len(seen) > 12 else "")
    return QuantizationError(
        f"nothing to quantize: dynamic int8 converts {what}, and this model has none "
        f"(its ops: {ops or 'none'}); serve it in fp32 without --quantize"
    )


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
    try:
        report = convert(src, dst, fmt, sample_inputs, options, validation)
        if report.validation is not None:
            check_tolerance(report.validation, tolerance or Tolerance())
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    return report


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
    if not src.is_file():
        raise QuantizationError(f"model file not found: {src.name}")
    if not sample:
        raise QuantizationError("quantizing needs a sample input to measure int8 against fp32")
    engine: str | None = None
    if fmt == "onnx":
        quantized, seen = _quantize_onnx(src, dst, options)
        left: dict[str, int] = {}
        fp32_run, int8_run = _onnx_runner(src, options.threads), _onnx_runner(dst, options.threads)
    else:
        fp32_module, int8_module, engine = _quantize_torchscript(src, dst, options)
        quantized, left, seen = _torch_ops(int8_module)
        fp32_run, int8_run = _torch_runner(fp32_module), _torch_runner(int8_module)
    if not quantized:
        raise _nothing_to_quantize(fmt, seen)
    if left:
        log.warning(
            "%s left in fp32 (%s); quantize from the eager model file to convert LSTM/GRU",
            src.name, ", ".join(f"{v} {k}" for k, v in left.items()),
        )  # fmt: skip
    try:
        with _quiet(), _torch_threads(options.threads):
            diff = max_abs_diff(fp32_run(sample), int8_run(sample))
            fp32_ms, int8_ms = _latency_ms(fp32_run, int8_run, sample, options.latency_runs)
            checked = compare(fp32_run, int8_run, validation) if validation else None
    except QuantizationError:
        raise
    except Exception as exc:
        raise QuantizationError(f"the int8 model failed on the sample input: {exc}") from None
    fp32_bytes = src.stat().st_size
    return QuantizationReport(
        model_format=fmt,
        source_sha256=sha256_of(src),
        fp32_bytes=fp32_bytes,
        int8_bytes=dst.stat().st_size,
        fp32_latency_ms=round(fp32_ms, 5),
        int8_latency_ms=round(int8_ms, 5),
        max_abs_diff=diff,
        quantized_ops=quantized,
        left_float=left,
        engine=engine,
        options=options.key(),
        validation=checked,
        int8_sha256=sha256_of(dst),
    )
