"""What the archiver checks about a model file before packing it: it loads, and its signature.

TorchScript files are loaded with `torch.jit.load` on the CPU; ONNX files pass `onnx.checker`, may
not reference external data outside their folder, and must open in an onnxruntime session;
`.pt2` packages run through the AOTInductor runtime (archiver/pt2_export.py). A sample input,
when given, must run. The signature comes from the ONNX graph, and for TorchScript and `.pt2`
(whose files do not record shapes) from the sample input; the batch dimension is recorded as -1.

The `torch.jit` calls here and in `handlers/backends` are the only ones outside quantization, so
their deprecation warnings are filtered locally around each call.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from scriptserve.archiver.manifest import ModelFormat
from scriptserve.handlers.runtime.signature import Signature, TensorSpec, datatype_of

# onnxruntime's type strings -> OIP datatypes.
_ORT_TYPES = {
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(float16)": "FP16",
    "tensor(bfloat16)": "BF16",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(bool)": "BOOL",
    "tensor(string)": "BYTES",
}


class ModelFileError(ValueError):
    """A model file that does not load or does not run; the message says what failed."""


ONNXRUNTIME_MISSING = (
    "ONNX models need ONNX Runtime, which this installation lacks: install "
    "'scriptserve[onnx]' (the CPU build) or 'scriptserve[gpu]' (CUDA and TensorRT)"
)
"""ONNX Runtime is an extra, not a dependency: its CPU and GPU builds are two packages that
install the same module, so `pip install scriptserve[gpu]` could not replace a CPU build that
came with the package itself."""


def import_onnxruntime() -> ModuleType:
    """The `onnxruntime` module, or ModelFileError naming the extra that installs it."""
    try:
        module = importlib.import_module("onnxruntime")
    except ImportError:
        raise ModelFileError(ONNXRUNTIME_MISSING) from None
    return module


def probe_model(
    path: Path, fmt: ModelFormat, sample: Mapping[str, np.ndarray] | None = None
) -> Signature:
    """Load `path` with its backend, run `sample` if given, and return the model's signature."""
    if fmt == "pt2":
        from scriptserve.archiver.pt2_check import check_package

        return check_package(path, sample, None).signature
    if fmt == "onnx":
        return _probe_onnx(path, sample)
    return _probe_torchscript(path, sample)


def _dim(d: Any) -> int:
    return d if isinstance(d, int) and d >= 0 else -1


def check_onnx_external_data(path: Path) -> None:
    """Refuse ONNX external-data references that leave the model's folder."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError for a file that is not ONNX, and others
        raise ModelFileError(f"the ONNX model does not load: {exc}") from None
    root = path.parent.resolve()
    for tensor in model.graph.initializer:
        if not uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (root / location).resolve()
        if Path(location).is_absolute() or not target.is_relative_to(root):
            raise ModelFileError(
                f"ONNX initializer {tensor.name!r} points to external data outside the model "
                f"folder ({location!r}); keep external data files beside the model"
            )


def _probe_onnx(path: Path, sample: Mapping[str, np.ndarray] | None) -> Signature:
    import onnx

    ort = import_onnxruntime()
    check_onnx_external_data(path)
    try:
        onnx.checker.check_model(str(path))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnx and onnxruntime raise many unrelated types
        raise ModelFileError(f"the ONNX model does not load: {exc}") from None

    def specs(args: list[Any]) -> tuple[TensorSpec, ...]:
        out = []
        for a in args:
            if a.type not in _ORT_TYPES:
                raise ModelFileError(f"ONNX tensor {a.name!r} has unsupported type {a.type}")
            out.append(TensorSpec(a.name, _ORT_TYPES[a.type], tuple(_dim(d) for d in a.shape)))
        return tuple(out)

    signature = Signature(specs(session.get_inputs()), specs(session.get_outputs()))
    if sample is not None:
        try:
            session.run(None, {k: np.ascontiguousarray(v) for k, v in sample.items()})
        except Exception as exc:
            raise ModelFileError(f"the ONNX model failed on the sample input: {exc}") from None
    return signature


def name_torchscript_outputs(result: Any) -> dict[str, Any]:
    """Name a TorchScript model's outputs: a tensor is output0, a tuple output0..N, a dict keeps
    its keys."""
    import torch

    if isinstance(result, torch.Tensor):
        return {"output0": result}
    if isinstance(result, (tuple, list)):
        return {f"output{i}": r for i, r in enumerate(result)}
    if isinstance(result, dict):
        return {str(k): v for k, v in result.items()}
    raise ModelFileError(
        f"the TorchScript model returned {type(result).__name__}; "
        "return a tensor, a tuple of tensors or a dict of tensors"
    )


def error_line(exc: BaseException) -> str:
    """The first line of an exception's message: torch's errors run on with hints and traces."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def interpreter_message(exc: BaseException) -> str:
    """The error itself, without the TorchScript interpreter's traceback of the scripted code."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("RuntimeError:"):
            return line.removeprefix("RuntimeError:").strip()
    return lines[-1] if lines else type(exc).__name__


def _probe_torchscript(path: Path, sample: Mapping[str, np.ndarray] | None) -> Signature:
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ModelFileError(
            f"the file does not load as TorchScript ({exc}); save it with torch.jit.save"
        ) from None
    module.eval()
    arg_names = [a.name for a in module.forward.schema.arguments[1:]]
    if sample is None:
        return Signature()
    if set(sample) != set(arg_names) and len(sample) == len(arg_names):
        # Inputs named generically (input0, ...) map to forward()'s arguments in order.
        sample = dict(zip(arg_names, sample.values(), strict=True))
    unknown = set(sample) - set(arg_names)
    if unknown:
        raise ModelFileError(
            f"sample input names {sorted(unknown)} are not arguments of "
            f"forward({', '.join(arg_names)})"
        )
    try:
        with torch.inference_mode():
            tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sample.items()}
            outputs = name_torchscript_outputs(module(**tensors))
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(
            f"the TorchScript model failed on the sample input: {interpreter_message(exc)}"
        ) from None
    inputs = tuple(
        TensorSpec(name, datatype_of(sample[name].dtype), (-1, *sample[name].shape[1:]))
        for name in arg_names
        if name in sample
    )
    outs = []
    for name, value in outputs.items():
        if not isinstance(value, torch.Tensor):
            raise ModelFileError(f"TorchScript output {name!r} is not a tensor")
        array = value.detach().cpu().numpy()
        outs.append(TensorSpec(name, datatype_of(array.dtype), (-1, *array.shape[1:])))
    return Signature(inputs, tuple(outs))
