"""`.pt2` packages at archive time: made from an eager model or an ExportedProgram, or brought
by the user; checked by archiver/pt2_check.py through the C ABI the server uses.

`build_package` exports with a dynamic batch dimension, `Dim("batch", min=1, max=max_batch)`
(exporting with a fixed batch and re-exporting later fails: the first export records a guard
that the batch equals the example's), and compiles with
`torch._inductor.aoti_compile_and_package`. fp32 models compile under `torch.no_grad()` with
Inductor freezing, which prepacks linear weights for oneDNN: 1.25x faster on the bench MLP
(Inductor freezes only while grad is off). The largest batch is `--max-batch`, else the model
config's `batchSize`, else 256.

Compiling writes to Inductor's cache (TORCHINDUCTOR_CACHE_DIR, by default under /tmp): about
23 s from an empty cache, 8 s from a warm one, for the bench MLP on 2 cores.

    build = build_package(Pt2Source(weights=Path("w.pt"), model_file=Path("model.py")),
                          sample, max_batch=64, dst=Path("work/model.pt2"))
    build.signature, build.info.max_batch  # what the manifest records
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scriptserve.archiver.model_file import ModelFileError, error_line
from scriptserve.archiver.model_source import load_eager_model, load_exported_program
from scriptserve.archiver.pt2_check import Pt2Build, check_at_bound, check_package
from scriptserve.archiver.pt2_package import is_exported_program, portable_march

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

DEFAULT_MAX_BATCH = 256
BATCH_SIZE_KEYS = ("batchSize", "batch_size")
"""Model config keys whose value bounds the exported batch when --max-batch is not given."""


def max_batch_from(flag: int | None, config: Mapping[str, Any] | None) -> int:
    """The largest batch to export for: the flag, else the config's batch size, else 256."""
    if flag is not None:
        if flag < 1:
            raise ModelFileError("--max-batch must be at least 1")
        return flag
    for key in BATCH_SIZE_KEYS:
        value = (config or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return DEFAULT_MAX_BATCH


@dataclass(frozen=True)
class Pt2Source:
    """What to make a package from: an ExportedProgram file, or an eager model's state dict
    (`weights`) with the Python file defining its class."""

    weights: Path
    model_file: Path | None = None
    model_class: str | None = None


# -- export and compile ---------------------------------------------------------------------
def _bind(sample: Mapping[str, np.ndarray], names: list[str], what: str) -> dict[str, np.ndarray]:
    """Name the sample's arrays by the model's inputs (generic names map in order)."""
    if set(sample) != set(names) and len(sample) == len(names):
        return dict(zip(names, sample.values(), strict=True))
    unknown = sorted(set(sample) - set(names))
    missing = [n for n in names if n not in sample]
    if unknown or missing:
        raise ModelFileError(
            f"the sample input names {', '.join(sample)} and {what} takes {', '.join(names)}"
        )
    return {n: sample[n] for n in names}


def export_model(
    model: torch.nn.Module, sample: Mapping[str, np.ndarray], max_batch: int, device: str = "cpu"
) -> ExportedProgram:
    """torch.export of `model` on `sample`, dim 0 of every input dynamic up to `max_batch`."""
    import torch
    from torch.export import Dim

    params = inspect.signature(model.forward).parameters.values()
    names = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        and (p.default is p.empty or p.name in sample)
    ]
    named = _bind(sample, names, f"forward({', '.join(names)})")
    rows = {a.shape[0] for a in named.values()}
    if len(rows) != 1 or min(rows) > max_batch:
        raise ModelFileError(f"the sample needs one batch size of 1 to {max_batch} rows")
    tensors = {n: torch.from_numpy(np.ascontiguousarray(a)).to(device) for n, a in named.items()}
    if max_batch > 1 and rows == {1}:
        # An example of one row would specialise the batch dimension to 1.
        tensors = {n: torch.cat([t, t]) for n, t in tensors.items()}
    batch = Dim("batch", min=1, max=max_batch) if max_batch > 1 else None
    dynamic = tuple({0: batch} if batch is not None else None for _ in tensors)
    model = model.to(device)
    if not isinstance(model, torch.fx.GraphModule):  # an exported module refuses eval()
        model.eval()
    try:
        with torch.no_grad():
            return torch.export.export(model, tuple(tensors.values()), dynamic_shapes=dynamic)
    except Exception as exc:
        raise ModelFileError(f"torch.export failed: {error_line(exc)}") from None


def compile_options() -> dict[str, Any]:
    """Inductor configs for an fp32 package: freezing, and a portable -march for the vector ISA
    Inductor picks here (its default, -march=native, ties the package to CPUs like this one)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    options: dict[str, Any] = {"freezing": True}
    march = portable_march(str(pick_vec_isa()))
    if march is not None:
        options["cpp.march"] = march
    return options


def compile_package(program: ExportedProgram, dst: Path, options: Mapping[str, Any]) -> Path:
    """AOTInductor-compile `program` into the package `dst`, without grad: Inductor freezes
    only then."""
    import torch
    import torch._inductor

    try:
        with torch.no_grad():
            made = torch._inductor.aoti_compile_and_package(
                program, package_path=str(dst), inductor_configs=dict(options)
            )
    except Exception as exc:
        raise ModelFileError(f"AOTInductor compilation failed: {error_line(exc)}") from None
    return Path(made)


def load_source(
    source: Pt2Source, sample: Mapping[str, np.ndarray], max_batch: int | None, device: str = "cpu"
) -> tuple[Any, ExportedProgram, str]:
    """(the model as a module, its ExportedProgram, "eager" or "exported-program"). An eager
    model is exported for batches of 1 to `max_batch` (None: DEFAULT_MAX_BATCH)."""
    if source.model_file is not None:
        model = load_eager_model(source.model_file, source.weights, source.model_class)
        return model, export_model(model, sample, max_batch or DEFAULT_MAX_BATCH, device), "eager"
    program = load_exported_program(source.weights)
    return program.module(), program, "exported-program"


def build_package(
    source: Pt2Source,
    sample: Mapping[str, np.ndarray],
    max_batch: int | None,
    dst: Path,
    device: str = "cpu",
) -> Pt2Build:
    """Export (or load) the model, compile it into `dst`, and check the package on `sample`
    against the model it came from. An eager model is exported for batches of 1 to
    `max_batch` (None: DEFAULT_MAX_BATCH); an ExportedProgram keeps its own dynamic shapes,
    and `max_batch` may only lower its bound."""
    import torch
    from torch.utils._pytree import tree_leaves

    started = time.perf_counter()
    model, program, kind = load_source(source, sample, max_batch, device)
    options = compile_options() if device == "cpu" else {"freezing": True}
    compile_package(program, dst, options)
    seconds = time.perf_counter() - started
    named = _bind(sample, list(program.graph_signature.user_inputs), "the exported program")
    with torch.no_grad():
        expected = model(*(torch.from_numpy(np.ascontiguousarray(a)).to(device)
                           for a in named.values()))  # fmt: skip
    reference = [t.detach().cpu().numpy() for t in tree_leaves(expected)]
    bound = program_batch_bound(program)
    if kind == "exported-program" and max_batch is not None:
        bound = min(bound or max_batch, max_batch)
    build = check_package(
        dst, named, None, kind, {**options, "noGrad": True}, reference, exported_bound=bound
    )
    if bound is not None and bound > 1:
        check_at_bound(dst, model, named, bound, device)
    diff = "" if build.max_abs_diff is None else f", max |pt2 - {kind}| {build.max_abs_diff:.3g}"
    target = build.info.target
    report = (
        f"pt2: compiled in {seconds:.1f} s for {target.isa or target.device} "
        f"({target.march or target.cuda_arch or 'default flags'}), batch 1 to "
        f"{build.info.max_batch}{diff}"
    )
    return Pt2Build(build.package, build.info, build.signature, report, build.max_abs_diff)


def program_batch_bound(program: ExportedProgram) -> int | None:
    """The largest batch (dim 0 of the first input) `program` was exported for; None when
    unbounded or static."""
    import sympy

    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    user = set(program.graph_signature.user_inputs)
    shapes = [n.meta["val"].shape for n in placeholders if n.name in user and "val" in n.meta]
    if not shapes or not len(shapes[0]):
        return None
    batch = shapes[0][0]
    if isinstance(batch, int):
        return batch
    ranges = program.range_constraints.get(batch.node.expr)
    if ranges is None or not isinstance(ranges.upper, (int, sympy.Integer)):
        return None
    return int(ranges.upper)


def is_pt2_source(path: Path) -> bool:
    """A `.pt2` file holding an ExportedProgram, which model-archiver compiles."""
    return path.suffix.lower() == ".pt2" and is_exported_program(path)
