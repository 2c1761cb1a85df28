"""int8 `.pt2` packages through torchao's PT2E flow, with a check that the compiled code really
runs int8 kernels.

The model (eager, or an ExportedProgram) is exported, annotated by torchao's
`X86InductorQuantizer` (dynamic activations by default; static with calibration on validation
samples), converted, exported again with the dynamic batch and compiled by AOTInductor with
Inductor freezing under `torch.no_grad()`. Only that compile fuses the quantized linears into
oneDNN int8 kernels (`aoti_torch_cpu__qlinear_pointwise…`); without freezing the int8 weights are
dequantized to fp32 before every GEMM, smaller and slower than fp32 with no warning
(pytorch/ao#4566). `int8_kernels` reads the generated code; `convert` refuses a package without
them, and the manifest records the kernels it found.

    done = convert(Pt2Source(weights, model_file), sample, dst, max_batch=64, static=False)
    done.kernels  # {"aoti_torch_cpu__qlinear_pointwise_tensor": 3}

Only CPU packages: the X86 Inductor quantizer targets x86 CPUs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scriptserve.archiver.accuracy import QuantizationError, ValidationSamples
from scriptserve.archiver.model_file import ModelFileError
from scriptserve.archiver.pt2_export import (
    Pt2Source,
    compile_options,
    compile_package,
    export_model,
    load_source,
)
from scriptserve.archiver.pt2_package import Pt2Package, Pt2PackageError, read_package

if TYPE_CHECKING:
    from torch.export import ExportedProgram

_INT8_CALL = re.compile(r"\b(aoti_torch_cpu__q(?:linear|conv\w*?)_pointwise\w*)\s*\(")
"""A call of one of oneDNN's fused int8 linear or convolution kernels in the generated code."""
_DEQUANTIZE_KERNEL = re.compile(r"\b(cpp_fused\w*dequantize_per_channel\w*)\b")
"""A generated kernel that turns int8 weights back into fp32: the freezing-less fallback."""

CONVERTS = "Linear and Conv layers (torchao's X86InductorQuantizer)"
"""What the PT2E flow quantizes, for the nothing-to-quantize error."""
CALIBRATION_ROWS = 64
"""Rows per calibration batch of a static conversion."""


@dataclass(frozen=True)
class Pt2Int8:
    """An int8 package written by `convert`, and what it holds."""

    package: Path
    kernels: dict[str, int]
    """Fused int8 kernels the compiled code calls, with their call counts."""
    quantized_layers: int
    """Weights the quantizer converted to int8."""
    ops: list[str]
    """The fp32 model's ATen ops, named in the error when nothing was quantized."""
    options: dict[str, Any]
    """How it was quantized and compiled, as the manifest records it."""


def int8_kernels(package: Pt2Package) -> dict[str, int]:
    """The fused int8 kernels a compiled package calls, with their call counts."""
    return dict(sorted(Counter(m.group(1) for m in _INT8_CALL.finditer(package.wrapper)).items()))


def dequantizing_kernels(package: Pt2Package) -> list[str]:
    """Generated kernels that dequantize int8 weights to fp32 on every call."""
    return sorted(set(_DEQUANTIZE_KERNEL.findall(package.wrapper)))


def check_kernels(path: Path) -> dict[str, int]:
    """The int8 kernels of the package at `path`; QuantizationError when it has none (its int8
    weights would be dequantized to fp32 before every matrix multiply)."""
    try:
        package = read_package(path)
    except Pt2PackageError as exc:
        raise QuantizationError(str(exc)) from None
    found = int8_kernels(package)
    if found:
        return found
    fallback = dequantizing_kernels(package)
    how = (
        f"it dequantizes its int8 weights to fp32 on every call ({', '.join(fallback[:3])})"
        if fallback
        else "it calls no fused int8 kernel"
    )
    raise QuantizationError(
        f"the compiled int8 package runs no int8 kernels: {how}, so it would be slower than fp32 "
        "(pytorch/ao#4566). The fused kernels come from Inductor freezing, which runs only "
        "with freezing on and grad disabled while compiling; compile it that way, or serve fp32"
    )


def _calibration(
    sample: Mapping[str, np.ndarray],
    validation: ValidationSamples | None,
    static: bool,
    rows: int = CALIBRATION_ROWS,
) -> Iterator[list[np.ndarray]]:
    """Input batches to run the prepared model on: the validation samples in batches of `rows`
    for a static conversion (which needs them), the sample for a dynamic one."""
    if not static:
        yield list(sample.values())
        return
    if validation is None:
        raise QuantizationError(
            "static-int8 calibrates activation ranges on validation samples: give "
            "--validation-file (or use dynamic-int8)"
        )
    names = list(sample)
    inputs = validation.inputs
    arrays = [inputs[n] for n in names] if set(inputs) == set(names) else list(inputs.values())
    for start in range(0, validation.rows, rows):
        yield [a[start : start + rows] for a in arrays]


def _quantized_weights(model: Any) -> int:
    """Weights a converted model holds as int8: one per-channel dequantize node each."""
    target = "quantized_decomposed.dequantize_per_channel"
    return sum(1 for n in model.graph.nodes if n.op == "call_function" and target in str(n.target))


def include_zero_in_ranges(model: Any) -> int:
    """Hand each dynamic `choose_qparams` the range [min(x, 0), max(x, 0)] instead of `x`;
    returns how many it changed.

    The reference op widens an activation's range to include zero before it takes the scale
    and zero point; Inductor's lowering of it (torch 2.13) does not. An input whose values are
    all positive (pixel intensities) or all negative then gets a zero point clamped to the edge
    and loses most of its range: 0.14 of error on outputs of about 0.3 in the tests' MLP. With
    the range given as two values, the compiled and the reference quantization agree, and the
    fused int8 kernels are unchanged."""
    import torch

    graph = model.graph
    target = torch.ops.quantized_decomposed.choose_qparams.tensor
    aten = torch.ops.aten
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != target:
            continue
        value = node.args[0]
        with graph.inserting_before(node):
            low = graph.call_function(aten.amin.default, (value,))
            high = graph.call_function(aten.amax.default, (value,))
            low = graph.call_function(aten.clamp_max.default, (low, 0.0))
            high = graph.call_function(aten.clamp_min.default, (high, 0.0))
            bounds = graph.call_function(aten.stack.default, ([low, high],))
        node.replace_input_with(value, bounds)
        changed += 1
    if changed:
        model.recompile()
    return changed


def one_channel_convolutions(graph: Any) -> tuple[str, ...]:
    """Module names of the convolutions of an exported graph whose input has one channel.

    These stay fp32 in every int8 flow: Inductor's int8 convolution of a one-channel input
    (LeNet's first layer on grey images) answers wrongly once the batch is dynamic (measured,
    torch 2.13: 153 of 200 digits classified differently from the reference quantized model),
    and such a layer holds a few hundred weights, too few to matter for size or speed."""
    import torch

    aten = torch.ops.aten
    convolutions = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
    names = []
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target not in convolutions:
            continue
        value = getattr(node.args[0], "meta", {}).get("val")
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if value is not None and value.shape[1] == 1 and stack and stack[-1][0]:
            names.append(str(stack[-1][0]))
    return tuple(names)


def drop_eval_dropout(graph: Any) -> int:
    """Remove the no-op dropouts (`train=False`) an eval-mode export keeps (Hugging Face models
    have one after every embedding and attention block); returns how many.

    torchao's dynamic conversion looks for the `choose_qparams` of a linear's input among the
    users of the node that feeds it; a dropout between them leaves it none to find, and
    `convert_pt2e` fails ("No chose qparams node found for linear")."""
    import torch

    dropout = torch.ops.aten.dropout.default
    removed = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target != dropout:
            continue
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if train:
            continue
        node.replace_all_uses_with(node.args[0])
        graph.graph.erase_node(node)
        removed += 1
    if removed:
        graph.recompile()
    return removed


def _aten_ops(program: Any) -> list[str]:
    nodes = program.graph.nodes
    return sorted({str(n.target) for n in nodes if n.op == "call_function"})


def convert(
    source: Pt2Source | ExportedProgram,
    sample: Mapping[str, np.ndarray],
    dst: Path,
    max_batch: int,
    static: bool = False,
    validation: ValidationSamples | None = None,
    reduce_range: bool = False,
    max_seq_len: int | None = None,
) -> Pt2Int8:
    """Quantize the model of `source` (files, or a program exported with its dynamic batch)
    with torchao's PT2E flow and compile the int8 package `dst` for batches of 1 to
    `max_batch` (and sequences of 1 to `max_seq_len`, for a model of token sequences).
    QuantizationError when nothing is quantized (no package is compiled then) or
    the compiled code has no int8 kernels."""
    import torch
    import torchao
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    # The exported graph takes at most `max_batch` rows: calibrate in batches it accepts.
    batches = list(_calibration(sample, validation, static, min(CALIBRATION_ROWS, max_batch)))
    if isinstance(source, Pt2Source):
        try:
            loaded = load_source(source, sample, max_batch, max_seq_len=max_seq_len)
        except ModelFileError as exc:
            raise QuantizationError(str(exc)) from None
        program, kind = loaded.program, loaded.kind
    else:
        program, kind = source, "exported-program"
    quantizer = X86InductorQuantizer()
    quantizer.set_global(
        get_default_x86_inductor_quantization_config(
            is_dynamic=not static, reduce_range=reduce_range
        )
    )
    graph = program.module()
    drop_eval_dropout(graph)
    left_float = one_channel_convolutions(graph)
    for name in left_float:
        quantizer.set_module_name_qconfig(name, None)
    # An int8 max-pool compiles into a fallback call through AOTInductor's proxy executor,
    # which the C-ABI runtime does not provide; in fp32 it is a generated kernel, as fast.
    quantizer.set_function_type_qconfig(torch.nn.functional.max_pool2d, None)
    quantizer.set_module_type_qconfig(torch.nn.MaxPool2d, None)
    try:
        prepared = prepare_pt2e(graph, quantizer)
        move_exported_model_to_eval(prepared)
        with torch.no_grad():
            for batch in batches:
                prepared(*(torch.from_numpy(np.ascontiguousarray(a)) for a in batch))
        converted = convert_pt2e(prepared)
        include_zero_in_ranges(converted)
    except QuantizationError:
        raise
    except Exception as exc:  # torchao raises what the model's ops raise
        raise QuantizationError(f"torchao's PT2E quantization failed: {exc}") from None
    options: dict[str, Any] = {
        "flow": "pt2e",
        "quantizer": "X86InductorQuantizer",
        "scheme": "static" if static else "dynamic",
        "reduceRange": reduce_range,
        "torchao": torchao.__version__,
        "source": kind,
    }
    if left_float:
        options["leftFloat"] = list(left_float)
    quantized = _quantized_weights(converted)
    if not quantized:
        return Pt2Int8(dst, {}, 0, _aten_ops(program), options)
    try:
        int8_program = export_model(converted, sample, max_batch, max_seq_len=max_seq_len)
        compiled = compile_options()
        compile_package(int8_program, dst, compiled)
    except ModelFileError as exc:
        raise QuantizationError(f"the int8 model: {exc}") from None
    kernels = check_kernels(dst)
    options["compileOptions"] = {**compiled, "noGrad": True}
    return Pt2Int8(dst, kernels, quantized, _aten_ops(program), options)
