"""What every int8 format module takes and gives back: the options, one conversion's result,
and the converter that archiver/quantize.py dispatches to by model format."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scriptserve.archiver.accuracy import Runner
from scriptserve.archiver.pt2_package import lacks_vnni

ONNX_OP_TYPES = ("MatMul", "Gemm", "Attention", "LSTM")
"""ONNX node types quantized by default (ConvInteger is rarely faster on CPUs)."""


@dataclass(frozen=True)
class QuantizeOptions:
    """How to quantize. The defaults suit x86-64 CPUs."""

    weight_type: str = "qint8"
    """ONNX weight type, `qint8` or `quint8` (TorchScript weights are always qint8)."""
    per_channel: bool = False
    """One scale per output channel of each weight instead of one per tensor."""
    reduce_range: bool | None = None
    """7-bit activations (PT2) or weights (ONNX), which keep int8 accurate on x86 CPUs without
    VNNI (TorchScript's fbgemm kernels already do it). None: on where this CPU lacks VNNI."""
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

    def reduces_range(self) -> bool:
        """`reduce_range`, decided for this CPU when it is None."""
        return lacks_vnni() if self.reduce_range is None else self.reduce_range

    def key(self) -> dict[str, Any]:
        """What changes the int8 file (the cache key), as JSON-able values."""
        return {
            "weightType": self.weight_type,
            "perChannel": self.per_channel,
            "reduceRange": self.reduces_range(),
            "opTypes": list(self.op_types),
            "engine": self.engine,
        }


@dataclass(frozen=True)
class Int8Conversion:
    """An int8 file a format module has written, and how to run it beside its fp32 source."""

    fp32: Runner
    int8: Runner
    quantized_ops: dict[str, int]
    """Int8 op kinds in the written model, with their counts."""
    left_float: dict[str, int]
    """Layers of a kind dynamic int8 converts that stayed fp32, with their counts."""
    ops: list[str]
    """Every op kind of the model, named in the error when nothing was quantized."""
    engine: str | None = None
    """The torch quantized engine the int8 model runs on, where there is one."""


@dataclass(frozen=True)
class Int8Converter:
    """One model format's dynamic int8: what its module under archiver/int8/ provides."""

    suffix: str
    """The int8 file's suffix, as the model format expects it (`.pt`, `.onnx`)."""
    converts: str
    """What dynamic int8 converts in this format, for the nothing-to-quantize error."""
    convert: Callable[[Path, Path, QuantizeOptions], Int8Conversion]
    """Write the int8 version of `src` to `dst`; raises QuantizationError."""
    measuring: Callable[[QuantizeOptions], AbstractContextManager[None]]
    """The settings both versions run under while they are measured."""
    versions: Callable[[], dict[str, str]]
    """The libraries whose versions change the int8 file (part of the load-time cache key)."""
