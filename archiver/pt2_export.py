"""`.pt2` packages at archive time: made from an eager model or an ExportedProgram, or brought
by the user; checked by archiver/pt2_check.py through the C ABI the server uses.

`build_package` exports with a dynamic batch dimension, `Dim("batch", min=1, max=max_batch)`
(exporting with a fixed batch and re-exporting later fails: the first export records a guard that
the batch equals the example's) and, for models of token sequences, a dynamic sequence dimension
`Dim("seq", min=1, max=max_seq_len)` shared by every input shaped [batch, seq, ...] (`input_ids`,
`attention_mask`, `token_type_ids`), so that a request is padded to its batch's longest row rather
than to the sample's length. The bound is `--max-seq-len`, else a Hugging Face model's
`config.max_position_embeddings` when the sample holds token ids. The model is called with its
inputs by keyword, so a sample may name any of its forward's parameters. It compiles with
`torch._inductor.aoti_compile_and_package`. fp32 models compile under `torch.no_grad()` with
Inductor freezing, which prepacks linear weights for oneDNN, measurably faster on the bench MLP
(benchmarks/README.md; Inductor freezes only while grad is off). The largest batch is `--max-batch`,
else the model config's `batchSize`, else 256.

Compiling writes to Inductor's cache (TORCHINDUCTOR_CACHE_DIR, by default under /tmp); a warm
cache takes a fraction of a cold compile's time (benchmarks/README.md).

    build = build_package(Pt2Source(weights=Path("w.pt"), model_file=Path("model.py")),
                          sample, max_batch=64, dst=Path("work/model.pt2"))
    build.signature, build.info.max_batch  # what the manifest records
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scriptserve.archiver.model_file import ModelFileError, error_line
from scriptserve.archiver.model_source import load_eager_model, load_exported_program
from scriptserve.archiver.precision import reduced
from scriptserve.archiver.pt2_check import (
    Pt2Build,
    check_at_bound,
    check_package,
    model_outputs,
)
from scriptserve.archiver.pt2_package import is_exported_program, portable_march
from scriptserve.handlers.runtime.aoti import SHARED_CXX_RUNTIME

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

DEFAULT_MAX_BATCH = 256
BATCH_SIZE_KEYS = ("batchSize", "batch_size")
"""Model config keys whose value bounds the exported batch when --max-batch is not given."""


def max_seq_len_from(flag: int | None, model: Any, sample: Mapping[str, np.ndarray]) -> int | None:
    """The largest sequence to export for: the flag, else the `max_position_embeddings` of a
    Hugging Face model's config when the sample holds token ids ([batch, seq] integers); None:
    every dimension but the batch keeps the sample's size."""
    if flag is not None:
        if flag < 1:
            raise ModelFileError("--max-seq-len must be at least 1")
        return flag
    token_ids = any(a.ndim == 2 and a.dtype.kind in "iu" for a in sample.values())
    if not token_ids or not hasattr(model, "modules"):
        return None
    for module in model.modules():
        bound = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        if isinstance(bound, int) and not isinstance(bound, bool) and bound > 1:
            return bound
    return None


def sequence_inputs(sample: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """The inputs whose dim 1 is the sequence: every input of rank 2 or more whose dim 1 has
    the length of the first such input's."""
    shaped = [(n, a.shape[1]) for n, a in sample.items() if a.ndim >= 2]
    if not shaped:
        return ()
    length = shaped[0][1]
    return tuple(n for n, size in shaped if size == length)


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
def bind_sample(
    sample: Mapping[str, np.ndarray], names: list[str], what: str
) -> dict[str, np.ndarray]:
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
    model: torch.nn.Module,
    sample: Mapping[str, np.ndarray],
    max_batch: int,
    device: str = "cpu",
    max_seq_len: int | None = None,
) -> ExportedProgram:
    """torch.export of `model` on `sample`, called with its inputs by keyword: dim 0 of every
    input dynamic up to `max_batch`, and with `max_seq_len`, dim 1 of the sequence inputs up to
    it."""
    import torch

    params = inspect.signature(model.forward).parameters.values()
    names = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        and (p.default is p.empty or p.name in sample)
    ]
    named = bind_sample(sample, names, f"forward({', '.join(names)})")
    rows = {a.shape[0] for a in named.values()}
    if len(rows) != 1 or min(rows) > max_batch:
        raise ModelFileError(f"the sample needs one batch size of 1 to {max_batch} rows")
    tensors = {n: torch.from_numpy(np.ascontiguousarray(a)).to(device) for n, a in named.items()}
    if max_batch > 1 and rows == {1}:
        # An example of one row would specialise the batch dimension to 1.
        tensors = {n: torch.cat([t, t]) for n, t in tensors.items()}
    dims = _dynamic_dims(named, max_batch, max_seq_len)
    tensors = {n: _widen(t, dims[n]) for n, t in tensors.items()}
    model = model.to(device)
    graph = isinstance(model, torch.fx.GraphModule)
    if not graph:  # an exported module refuses eval()
        model.eval()
    try:
        with torch.no_grad():
            if graph:  # an exported program's module takes its inputs in order, as exported
                shapes = tuple(dims.values())
                return torch.export.export(model, tuple(tensors.values()), dynamic_shapes=shapes)
            return torch.export.export(model, (), kwargs=tensors, dynamic_shapes=dims)
    except Exception as exc:
        raise ModelFileError(
            f"torch.export failed: {error_line(exc)}{_dtype_hint(exc, named)}"
        ) from None


def _dynamic_dims(
    named: Mapping[str, np.ndarray], max_batch: int, max_seq_len: int | None
) -> dict[str, dict[int, Any] | None]:
    """export's dynamic_shapes, by input name: the batch, and the sequence when bounded."""
    from torch.export import Dim

    batch = Dim("batch", min=1, max=max_batch) if max_batch > 1 else None
    sequences: tuple[str, ...] = ()
    seq = None
    if max_seq_len is not None and max_seq_len > 1:
        sequences = sequence_inputs(named)
        if not sequences:
            raise ModelFileError(
                "--max-seq-len needs inputs shaped [batch, sequence, ...]; the sample has none"
            )
        longest = max(named[n].shape[1] for n in sequences)
        if longest > max_seq_len:
            raise ModelFileError(
                f"the sample's sequences have {longest} positions, more than --max-seq-len "
                f"{max_seq_len}"
            )
        seq = Dim("seq", min=1, max=max_seq_len)
    dims: dict[str, dict[int, Any] | None] = {}
    for name in named:
        dim: dict[int, Any] = {0: batch} if batch is not None else {}
        if name in sequences:
            dim[1] = seq
        dims[name] = dim or None
    return dims


def _widen(tensor: torch.Tensor, dims: Mapping[int, Any] | None) -> torch.Tensor:
    """A sequence of one position would specialise its dimension to 1: repeat it once."""
    import torch

    if dims and 1 in dims and tensor.shape[1] == 1:
        return torch.cat([tensor, tensor], dim=1)
    return tensor


def _dtype_hint(exc: Exception, named: Mapping[str, np.ndarray]) -> str:
    """What to do when the model refused the sample's dtypes."""
    text = str(exc)
    floats = [n for n, a in named.items() if a.dtype.kind == "f"]
    integers = [n for n, a in named.items() if a.dtype.kind in "iu"]
    if floats and ("Long, Int" in text or "indices" in text):
        return (
            f"; the sample's {', '.join(floats)} was read as floating point: write token ids "
            "as JSON integers, or give --input-dtype INT64"
        )
    if integers and ("Float" in text or "scalar type" in text or "dtype" in text):
        return (
            f"; the sample's {', '.join(integers)} holds JSON integers, read as INT64: write "
            "them with a decimal point (1.0), or give --input-dtype FP32"
        )
    return ""


def compile_options() -> dict[str, Any]:
    """Inductor configs for an fp32 package: freezing, and a portable -march for the vector ISA
    Inductor picks here (its default, -march=native, ties the package to CPUs like this one)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    options: dict[str, Any] = {"freezing": True}
    march = portable_march(str(pick_vec_isa()))
    # torch releases before the option (2.11) compile for this CPU; the manifest's target says
    # which -march the package was built with either way (read from its flags).
    if march is not None and hasattr(config.cpp, "march"):
        options["cpp.march"] = march
    return options


def link_options() -> dict[str, Any]:
    """Link the package's library against the shared C++ runtime, named by its file
    (`-l:libstdc++.so.6`). A compiler that finds only libstdc++'s static archive (a relocated
    GCC without the `libstdc++.so` link, as on some GPU images) or links it statically by
    default would otherwise give the library a copy of the runtime that clashes with torch's
    and crashes the process that loads it (`handlers.runtime.aoti` refuses such a library).
    Where the compiler links the shared runtime anyway, naming it changes nothing."""
    from torch._inductor import config

    if not hasattr(config.aot_inductor, "custom_op_libs"):  # a torch release without the option
        return {}
    return {"aot_inductor.custom_op_libs": [SHARED_CXX_RUNTIME]}


def compile_package(program: ExportedProgram, dst: Path, options: Mapping[str, Any]) -> Path:
    """AOTInductor-compile `program` into the package `dst`, without grad: Inductor freezes
    only then."""
    import torch
    import torch._inductor

    try:
        with torch.no_grad():
            made = torch._inductor.aoti_compile_and_package(
                program, package_path=str(dst), inductor_configs={**link_options(), **options}
            )
    except Exception as exc:
        raise ModelFileError(f"AOTInductor compilation failed: {error_line(exc)}") from None
    return Path(made)


@dataclass(frozen=True)
class LoadedModel:
    """The model a package is compiled from, as a module and as the program exported from it."""

    module: Any
    program: ExportedProgram
    kind: str
    """"eager" or "exported-program"."""
    max_seq_len: int | None = None
    """The sequence bound it was exported with; None: no dimension but the batch is dynamic."""


def load_source(
    source: Pt2Source,
    sample: Mapping[str, np.ndarray],
    max_batch: int | None,
    device: str = "cpu",
    max_seq_len: int | None = None,
    *,
    precision: str = "fp32",
) -> LoadedModel:
    """The model, exported for batches of 1 to `max_batch` (None: DEFAULT_MAX_BATCH) and, for
    models of token sequences, sequences of 1 to `max_seq_len` (None: the model config's
    bound, where it has one), running in `precision` (archiver/precision.py); an
    ExportedProgram keeps its own dynamic shapes and precision."""
    if source.model_file is not None:
        model = load_eager_model(source.model_file, source.weights, source.model_class)
        seq = max_seq_len_from(max_seq_len, model, sample)
        if precision != "fp32":
            model = reduced(model, precision)
        program = export_model(model, sample, max_batch or DEFAULT_MAX_BATCH, device, seq)
        return LoadedModel(model, program, "eager", seq)
    if precision != "fp32":
        raise ModelFileError(
            f"--precision {precision} converts the eager model: give its class (--model-file) "
            "and state dict rather than an ExportedProgram"
        )
    program = load_exported_program(source.weights)
    return LoadedModel(program.module(), program, "exported-program", program_seq_bound(program))


def build_package(
    source: Pt2Source,
    sample: Mapping[str, np.ndarray],
    max_batch: int | None,
    dst: Path,
    device: str = "cpu",
    max_seq_len: int | None = None,
    *,
    precision: str = "fp32",
) -> Pt2Build:
    """Export (or load) the model, compile it into `dst`, and check the package on `sample`
    against the model it came from, in `precision` (the caller's guard compares that with
    fp32). An eager model is exported for batches of 1 to `max_batch` (None:
    DEFAULT_MAX_BATCH) and sequences of 1 to `max_seq_len` (see `load_source`); an
    ExportedProgram keeps its own dynamic shapes, and `max_batch` may only lower its bound."""
    started = time.perf_counter()
    loaded = load_source(source, sample, max_batch, device, max_seq_len, precision=precision)
    model, program, kind = loaded.module, loaded.program, loaded.kind
    options = compile_options() if device == "cpu" else {"freezing": True}
    compile_package(program, dst, options)
    seconds = time.perf_counter() - started
    named = bind_sample(sample, list(program.graph_signature.user_inputs), "the exported program")
    reference = model_outputs(model, named, device)
    bound = program_batch_bound(program)
    if kind == "exported-program" and max_batch is not None:
        bound = min(bound or max_batch, max_batch)
    build = check_package(
        dst, named, None, kind, {**options, "noGrad": True}, reference, exported_bound=bound
    )
    sequences = sequence_inputs(named) if loaded.max_seq_len is not None else ()
    if bound is not None and bound > 1:
        check_at_bound(dst, model, named, bound, device, reduced=precision != "fp32")
    if sequences and loaded.max_seq_len is not None:
        check_at_bound(
            dst,
            model,
            named,
            2,
            device,
            seq=(sequences, loaded.max_seq_len),
            reduced=precision != "fp32",
        )
    diff = "" if build.max_abs_diff is None else f", max |pt2 - {kind}| {build.max_abs_diff:.3g}"
    target = build.info.target
    seq = "" if not sequences else f", sequences of 1 to {loaded.max_seq_len}"
    report = (
        f"pt2: compiled in {seconds:.1f} s for {target.isa or target.device} "
        f"({target.march or target.cuda_arch or 'default flags'}), batch 1 to "
        f"{build.info.max_batch}{seq}{diff}"
    )
    info = replace(
        build.info, max_seq_len=loaded.max_seq_len if sequences else None, precision=precision
    )
    signature = build.signature.with_dynamic_dim(1, sequences)
    return Pt2Build(build.package, info, signature, report, build.max_abs_diff)


def program_seq_bound(program: ExportedProgram) -> int | None:
    """The largest sequence (dim 1 of the first input of rank 2 or more) `program` was exported
    for; None when that dimension is static or there is none."""
    import sympy

    for shape in _user_input_shapes(program):
        if len(shape) < 2:
            continue
        size = shape[1]
        if isinstance(size, int):
            return None
        ranges = program.range_constraints.get(size.node.expr)
        if ranges is None or not isinstance(ranges.upper, (int, sympy.Integer)):
            return None
        return int(ranges.upper)
    return None


def _user_input_shapes(program: ExportedProgram) -> list[Any]:
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    user = set(program.graph_signature.user_inputs)
    return [n.meta["val"].shape for n in placeholders if n.name in user and "val" in n.meta]


def program_batch_bound(program: ExportedProgram) -> int | None:
    """The largest batch (dim 0 of the first input) `program` was exported for; None when
    unbounded or static."""
    import sympy

    shapes = _user_input_shapes(program)
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
