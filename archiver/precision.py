"""Reduced-precision `.pt2` packages (`--precision bf16|fp16`): the model compiled to run in
bfloat16 (CPUs with AVX512-BF16 or AMX, and GPUs) or float16 (GPUs), its inputs and outputs
kept float32, so that clients and handlers see the same signature as fp32's.

The eager model is cast to the precision and wrapped so that floating inputs are cast on the
way in and floating outputs back to float32 on the way out; the wrapper keeps the model's
`forward` signature, which the export reads the input names from. A CPU without bfloat16
instructions would run the package through slow emulation, so model-archiver refuses it there
and says what to use instead. The package is held to the accuracy guard against the fp32 model
on the validation samples (top-1 agreement, or cosine similarity for embedders), as int8 is.

    problem = precision_problem("bf16", "cpu")  # None on a CPU with AMX or AVX512-BF16
    model = reduced(model, "bf16")               # export and compile it as usual
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Collection, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scriptserve.archiver.accuracy import Tolerance, ValidationSamples, check_tolerance, compare
from scriptserve.archiver.model_source import load_eager_model
from scriptserve.archiver.pt2_check import PackageRunner, call_model, opened_package
from scriptserve.archiver.pt2_package import cpu_features, read_package

if TYPE_CHECKING:
    from scriptserve.archiver.pt2_export import Pt2Source

PRECISIONS = ("fp32", "bf16", "fp16")
_BF16_CPU = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))


def precision_isa(features: Collection[str] | None = None) -> str | None:
    """The bfloat16 instructions of this CPU (or one with `features`): AMX's tiles, AVX-512's
    bf16 dot products, or None."""
    features = cpu_features() if features is None else features
    return next((name for flag, name in _BF16_CPU if flag in features), None)


def precision_problem(
    precision: str, device: str, features: Collection[str] | None = None
) -> str | None:
    """Why a package of `precision` should not be compiled for `device` here, or None."""
    if precision == "fp32":
        return None
    if precision not in PRECISIONS:
        return f"--precision {precision!r}: use one of {', '.join(PRECISIONS)}"
    if device.startswith("cuda"):
        import torch

        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            return "this GPU has no bfloat16 support: use --precision fp16"
        return None
    if precision == "fp16":
        return (
            "--precision fp16 is for GPUs (--pt2-device cuda); on a CPU use bf16 (with AVX512-BF16 "
            "or AMX) or --quantize dynamic-int8"
        )
    if precision_isa(features) is None:
        return (
            "--precision bf16 needs a CPU with AVX512-BF16 or AMX, and this one has neither: it "
            "would run bfloat16 through slow emulation. Serve fp32, use --quantize dynamic-int8 "
            "or static-int8, or archive on (and serve from) a CPU with them"
        )
    return None


def reduced(model: Any, precision: str) -> Any:
    """`model` running in `precision`, taking and returning float32 tensors, with the same
    `forward` signature."""
    import torch
    from torch.utils._pytree import tree_map

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    signature = inspect.signature(model.forward)

    def cast(value: Any, to: torch.dtype) -> Any:
        if isinstance(value, torch.Tensor) and torch.is_floating_point(value):
            return value.to(to)
        return value

    class ReducedPrecision(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model.to(dtype)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            inputs = {name: cast(value, dtype) for name, value in bound.arguments.items()}
            return tree_map(lambda out: cast(out, torch.float32), self.inner(**inputs))

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = [self_parameter, *signature.parameters.values()]
    ReducedPrecision.forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters
    )
    return ReducedPrecision().eval()


def check_precision(
    package: Path,
    source: Pt2Source,
    samples: ValidationSamples,
    tolerance: Tolerance,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run the reduced-precision `package` and the fp32 eager model of `source` on `samples`;
    QuantizationError when the accuracy guard refuses it; the figures the manifest keeps."""
    import torch
    from torch.utils._pytree import tree_leaves

    model = load_eager_model(source.model_file, source.weights, source.model_class)  # type: ignore[arg-type]

    def fp32(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            outputs = tree_leaves(call_model(model, inputs))
        return {f"output{i}": t.float().numpy() for i, t in enumerate(outputs)}

    with contextlib.ExitStack() as stack:
        if device == "cpu":
            runner = PackageRunner(package)
            stack.callback(runner.close)

            def reduced_run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                return {f"output{i}": v for i, v in enumerate(runner(inputs).values())}
        else:  # loaded once for every sample, as on the CPU
            run = stack.enter_context(opened_package(read_package(package), "cuda:0"))

            def reduced_run(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                _, outputs = run(list(inputs.values()))
                return {f"output{i}": v for i, v in enumerate(outputs)}

        result = compare(fp32, reduced_run, samples)
    check_tolerance(result, tolerance, what="bf16/fp16")
    return {"isa": precision_isa() if device == "cpu" else device, "validation": asdict(result)}
