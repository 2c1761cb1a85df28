"""Dynamic int8 of a TorchScript model: `Linear` weights become qint8, with activations
quantized per batch at run time.

A scripted file goes through `torch.ao.quantization.quantize_dynamic_jit` (Linear only: its
LSTM/GRU stay fp32 and the report names them). An eager model (`options.model_file`, a Python
file with the `nn.Module` class, and `src` its state dict, read with `weights_only=True`) goes
through `torch.ao.quantization.quantize_dynamic` (Linear, LSTM, GRU) and is then scripted.

The torch quantized engine is `x86` on x86-64 (fbgemm kernels, plus oneDNN where it is faster;
dynamic Linear uses fbgemm with reduce_range, which is right for CPUs without VNNI too),
`fbgemm` on builds without `x86`, and `qnnpack` on ARM. `select_engine` sets it. torch.jit and
torch.ao.quantization warn that they are deprecated on torch 2.13; those warnings are filtered
here, around each call.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import threading
import warnings
import zipfile
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from scriptserve.archiver.accuracy import QuantizationError, Runner
from scriptserve.archiver.int8.conversion import Int8Conversion, Int8Converter, QuantizeOptions
from scriptserve.archiver.model_file import ModelFileError
from scriptserve.archiver.model_source import load_eager_model

log = logging.getLogger("scriptserve.quantize")

_FLOAT_OPS = {"aten::linear": "Linear", "aten::lstm": "LSTM", "aten::gru": "GRU"}
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


def convert(src: Path, dst: Path, options: QuantizeOptions) -> Int8Conversion:
    """Write the int8 version of `src` (a scripted file, or an eager model's state dict) to
    `dst`."""
    fp32, int8, engine = _quantize(src, dst, options)
    quantized, left, ops = _int8_ops(int8)
    if quantized and left:
        log.warning(
            "%s left in fp32 (%s); quantize from the eager model file to convert LSTM/GRU",
            src.name,
            ", ".join(f"{v} {k}" for k, v in left.items()),
        )
    return Int8Conversion(_runner(fp32), _runner(int8), quantized, left, ops, engine)


@contextlib.contextmanager
def measuring(options: QuantizeOptions) -> Iterator[None]:
    """torch's intra-op threads for a measurement (a server passes the count it already uses),
    with torch.jit's deprecation warnings filtered."""
    import torch

    before = torch.get_num_threads()
    if before != options.threads:
        torch.set_num_threads(options.threads)
    try:
        with _quiet():
            yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def versions() -> dict[str, str]:
    import torch

    return {"torch": torch.__version__}


def _quantize(src: Path, dst: Path, options: QuantizeOptions) -> tuple[Any, Any, str]:
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
            qconfig = (
                tq.per_channel_dynamic_qconfig
                if options.per_channel
                else (tq.default_dynamic_qconfig)
            )
            source = torch.jit.load(str(src), map_location="cpu").eval()  # type: ignore[no-untyped-call]
            try:
                int8 = tq.quantize_dynamic_jit(source, {"": qconfig})  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise QuantizationError(f"quantize_dynamic_jit failed: {exc}") from None
        int8.save(str(dst))
        int8 = torch.jit.load(str(dst), map_location="cpu").eval()  # type: ignore[no-untyped-call]
    return fp32, int8, engine


def _load_eager(model_file: Path, weights: Path, class_name: str | None) -> Any:
    try:
        return load_eager_model(model_file, weights, class_name)
    except ModelFileError as exc:
        raise QuantizationError(str(exc)) from None


def _int8_ops(int8: Any) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(quantized op counts, layers left fp32, the model's aten ops) of a scripted module."""
    counts: Counter[str] = Counter()

    def walk(block: Any) -> None:
        for node in block.nodes():
            counts[node.kind()] += 1
            for inner in node.blocks():
                walk(inner)

    walk(int8.inlined_graph)
    quantized = {
        k: v
        for k, v in sorted(counts.items())
        if "quantized" in k.split("::")[-1] or k.startswith("quantized::")
    }
    left = {_FLOAT_OPS[k]: v for k, v in counts.items() if k in _FLOAT_OPS}
    seen = sorted(k for k in counts if k.startswith("aten::") and not k.startswith("aten::_"))
    return quantized, left, seen


def _runner(module: Any) -> Runner:
    import torch

    names = [a.name for a in module.forward.schema.arguments[1:]]

    def run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from scriptserve.archiver.model_file import name_torchscript_outputs

        values = list(inputs.values()) if set(inputs) != set(names) else [inputs[n] for n in names]
        with torch.inference_mode():
            out = module(*(torch.from_numpy(np.ascontiguousarray(v)) for v in values))
        return {k: v.detach().numpy() for k, v in name_torchscript_outputs(out).items()}

    return run


CONVERTER = Int8Converter(
    suffix=".pt",
    converts="Linear layers (and LSTM/GRU from an eager model)",
    convert=convert,
    measuring=measuring,
    versions=versions,
)
