"""Dynamic int8 of an ONNX model: `onnxruntime.quantization.quantize_dynamic` on the node
types in `QuantizeOptions.op_types` (MatMul, Gemm, Attention and LSTM by default; Conv is left
out: ONNX Runtime's ConvInteger is rarely faster on CPUs)."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

from scriptserve.archiver.accuracy import QuantizationError, Runner
from scriptserve.archiver.int8.conversion import (
    ONNX_OP_TYPES,
    Int8Conversion,
    Int8Converter,
    QuantizeOptions,
)
from scriptserve.archiver.model_file import ModelFileError, import_onnxruntime

_INT8_OPS = {
    "MatMulInteger",
    "DynamicQuantizeMatMul",
    "DynamicQuantizeLSTM",
    "QAttention",
    "ConvInteger",
    "QGemm",
}


class _PreprocessingHintFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "pre-processing before quantization" not in record.getMessage()


def convert(src: Path, dst: Path, options: QuantizeOptions) -> Int8Conversion:
    """Write the int8 version of `src` to `dst`."""
    import onnx

    try:
        import_onnxruntime()
    except ModelFileError as exc:  # the message names the extra that installs it
        raise QuantizationError(str(exc)) from None
    from onnxruntime.quantization import QuantType, quantize_dynamic

    types = {"qint8": QuantType.QInt8, "quint8": QuantType.QUInt8}
    if options.weight_type not in types:
        raise QuantizationError(f"weight type {options.weight_type!r}: use qint8 or quint8")
    hint = _PreprocessingHintFilter()  # ONNX Runtime suggests its pre-processing on the root logger
    logging.getLogger().addFilter(hint)
    try:
        quantize_dynamic(
            src,
            dst,
            weight_type=types[options.weight_type],
            per_channel=options.per_channel,
            reduce_range=options.reduces_range(),
            op_types_to_quantize=list(options.op_types),
        )
    except Exception as exc:  # onnxruntime.quantization raises many unrelated types
        raise QuantizationError(f"onnxruntime quantize_dynamic failed: {exc}") from None
    finally:
        logging.getLogger().removeFilter(hint)
    nodes = Counter(n.op_type for n in onnx.load(str(dst), load_external_data=False).graph.node)
    quantized = {k: v for k, v in sorted(nodes.items()) if k in _INT8_OPS}
    return Int8Conversion(
        fp32=_runner(src, options.threads),
        int8=_runner(dst, options.threads),
        quantized_ops=quantized,
        left_float={},
        ops=sorted(nodes),
    )


def measuring(options: QuantizeOptions) -> AbstractContextManager[None]:
    """Nothing to set: each session has its threads from `options` already."""
    return contextlib.nullcontext()


def versions() -> dict[str, str]:
    return {"onnxruntime": import_onnxruntime().__version__}


def _runner(path: Path, threads: int) -> Runner:
    ort = import_onnxruntime()

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


CONVERTER = Int8Converter(
    suffix=".onnx",
    converts=f"{', '.join(ONNX_OP_TYPES)} nodes",
    convert=convert,
    measuring=measuring,
    versions=versions,
)
