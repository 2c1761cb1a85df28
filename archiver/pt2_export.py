"""`.pt2` packages at archive time: made from an eager model or an ExportedProgram, or brought
by the user, and checked by running the sample through the C ABI the server uses.

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

import contextlib
import inspect
import os
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scriptserve.archiver.aoti_runtime import AotiError, AotiLibrary
from scriptserve.archiver.manifest import Pt2Info
from scriptserve.archiver.model_file import ModelFileError, error_line
from scriptserve.archiver.model_source import load_eager_model, load_exported_program
from scriptserve.archiver.pt2_package import (
    Pt2Package,
    Pt2PackageError,
    is_exported_program,
    package_target,
    portable_march,
    read_package,
)
from scriptserve.archiver.signature import Signature, TensorSpec, datatype_of

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


@dataclass(frozen=True)
class Pt2Build:
    """A checked package: what the manifest records about it, and a line for the user."""

    package: Path
    info: Pt2Info
    signature: Signature
    report: str = ""
    max_abs_diff: float | None = field(default=None, compare=False)


# -- sources --------------------------------------------------------------------------------
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
        _check_at_bound(dst, model, named, bound, device)
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


def _check_at_bound(
    path: Path, model: Any, sample: Mapping[str, np.ndarray], bound: int, device: str
) -> None:
    """Run the package on `bound` rows and compare with the model. Inductor may write a lower
    bound into the generated input check than the exported one (15 for a small CNN exported
    for 64, whose outputs are right at 64): the exported bound is the one served, so it is
    checked here."""
    import torch
    from torch.utils._pytree import tree_leaves

    rng = np.random.default_rng(0)
    rows = {
        n: np.ascontiguousarray(
            np.repeat(a[:1], bound, axis=0)
            + (rng.standard_normal((bound, *a.shape[1:])) * 0.1).astype(a.dtype)
            if a.dtype.kind == "f"
            else np.repeat(a[:1], bound, axis=0)
        )
        for n, a in sample.items()
    }
    package = read_package(path)
    try:
        _, outputs = _run_once(package, device, list(rows.values()), input_checks=False)
    except AotiError as exc:
        raise ModelFileError(f"{path.name} failed on a batch of {bound} rows: {exc}") from None
    with torch.no_grad():
        expected = model(*(torch.from_numpy(a).to(device) for a in rows.values()))
    for got, want in zip(outputs, tree_leaves(expected), strict=True):
        want_np = want.detach().float().cpu().numpy()
        diff = float(np.max(np.abs(got - want_np))) if got.size else 0.0
        scale = max(1.0, float(np.max(np.abs(want_np)))) if want_np.size else 1.0
        if not diff <= 1e-3 * scale:
            raise ModelFileError(
                f"{path.name} differs from the model by {diff:.3g} on a batch of {bound} rows; "
                "export it with a lower --max-batch"
            )


# -- checking a package ---------------------------------------------------------------------
@contextlib.contextmanager
def _input_checks() -> Iterator[None]:
    """The generated code checks its inputs' dtypes and sizes when AOTI_RUNTIME_CHECK_INPUTS is
    set as a copy of it first runs: on for the archive-time check only."""
    before = os.environ.get("AOTI_RUNTIME_CHECK_INPUTS")
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["AOTI_RUNTIME_CHECK_INPUTS"]
        else:
            os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = before


@contextlib.contextmanager
def _runtime_stderr_dropped() -> Iterator[None]:
    """The runtime prints each error to stderr before returning it; model-archiver reports it
    once, in its own one-line message."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _run_once(
    package: Pt2Package, device: str, inputs: list[np.ndarray], input_checks: bool = True
) -> tuple[tuple[str, ...], list[np.ndarray]]:
    """(output names, outputs) of one run of the package on `inputs`, in the model's order."""
    import torch

    with tempfile.TemporaryDirectory(prefix="scriptserve-pt2-") as tmp:
        library = AotiLibrary(package.extract(Path(tmp)))
        cuda = device.startswith("cuda")
        container = library.create(1, device, Path(tmp) if cuda else None)
        try:
            takes = len(library.names(container, "Input"))
            if takes != len(inputs):
                raise ModelFileError(
                    f"{package.path.name} takes {takes} inputs and the sample has {len(inputs)}"
                )
            names = library.names(container, "Output")
            tensors = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in inputs]
            checks = _input_checks() if input_checks else contextlib.nullcontext()
            with checks, _runtime_stderr_dropped():
                results = library.run(container, tensors, len(names))
        finally:
            library.delete(container)
            library.close()
    arrays = [(t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()
              for t in results]  # fmt: skip
    return names, arrays


def check_package(
    path: Path,
    sample: Mapping[str, np.ndarray] | None,
    max_batch: int | None,
    source: str = "package",
    compile_options: Mapping[str, Any] | None = None,
    reference: list[np.ndarray] | None = None,
    exported_bound: int | None = None,
) -> Pt2Build:
    """Check that the package at `path` can be served, run it on `sample` (its arrays in the
    model's input order, named as the signature will name them) and describe it.

    The batch bound is the one the package was exported with (`exported_bound` when the
    caller exported it, else the bound in its generated input checks); `max_batch` may lower
    it, or stands in for it in a package exported without one.
    """
    import torch

    if sample is None:
        raise ModelFileError(
            "a .pt2 model needs --sample-input (or --input-shape): its signature is read from "
            "a run on it"
        )
    try:
        package = read_package(path)
    except Pt2PackageError as exc:
        raise ModelFileError(str(exc)) from None
    if package.uses_proxy_executor():
        raise ModelFileError(
            f"{path.name} calls operators through a proxy executor (custom operators), which "
            "scriptserve's runtime does not provide"
        )
    fixed = package.fixed_batch()
    if fixed is not None and fixed != 1:
        raise ModelFileError(
            f"{path.name} takes a fixed batch of {fixed}; export it with a dynamic batch "
            "dimension (Dim('batch', max=...)), or let model-archiver export it"
        )
    if exported_bound is not None:
        exported: int | None = exported_bound
    else:
        exported = 1 if fixed == 1 else package.batch_bound()
    if exported is not None and max_batch is not None and max_batch > exported:
        raise ModelFileError(
            f"--max-batch {max_batch} is more than the {exported} rows {path.name} was exported for"
        )
    bound = min((b for b in (exported, max_batch) if b is not None), default=None)
    device = "cuda:0" if package.device == "cuda" else "cpu"
    if package.device == "cuda" and not torch.cuda.is_available():
        raise ModelFileError(f"{path.name} is compiled for CUDA; archive it on a CUDA machine")
    inputs = list(sample.values())
    if bound != 1 and all(a.ndim and a.shape[0] == 1 for a in inputs):
        # The generated checks want a dynamic batch of at least 2 (export's 0/1 specialisation
        # rule); the serving path, without them, runs batches of 1 too.
        inputs = [np.concatenate([a, a]) for a in inputs]
        reference = None if reference is None else [np.concatenate([r, r]) for r in reference]
    try:
        names, outputs = _run_once(package, device, inputs)
    except AotiError as exc:
        raise ModelFileError(f"{path.name} failed on the sample input: {exc}") from None
    diff = None
    if reference is not None:
        if [o.shape for o in outputs] != [r.shape for r in reference]:
            raise ModelFileError("the compiled package's outputs differ in shape from the model's")
        pairs = zip(outputs, reference, strict=True)
        diff = max((float(np.max(np.abs(o - r))) for o, r in pairs), default=0.0)
    signature = Signature(
        tuple(TensorSpec(n, datatype_of(a.dtype), (-1, *a.shape[1:])) for n, a in sample.items()),
        tuple(TensorSpec(n, datatype_of(a.dtype), (-1, *a.shape[1:]))
              for n, a in zip(names, outputs, strict=True)),
    )  # fmt: skip
    info = Pt2Info(
        torch_version=torch.__version__,
        target=package_target(package),
        max_batch=bound,
        compile_options=dict(compile_options or {}),
        source=source,
    )
    return Pt2Build(path, info, signature, max_abs_diff=diff)


class PackageRunner:
    """A CPU `.pt2` package run in this process through the C ABI, one model instance, for
    measuring it at archive time (the int8 report, benchmarks). Inputs are taken by name, or
    in order when their names are not the package's; `close` (or garbage collection) frees it.

        runner = PackageRunner(Path("model.pt2"), threads=1)
        runner({"x": np.ones((32, 512), np.float32)})  # {"output0": ...}
    """

    def __init__(self, path: Path, threads: int = 1) -> None:
        try:
            package = read_package(path)
        except Pt2PackageError as exc:
            raise ModelFileError(str(exc)) from None
        if package.device != "cpu":
            raise ModelFileError(f"{path.name} is compiled for {package.device}, not for the CPU")
        self._dir = tempfile.TemporaryDirectory(prefix="scriptserve-pt2-run-")
        self._library = AotiLibrary(package.extract(Path(self._dir.name)))
        self._container = self._library.create(1, "cpu")
        self.inputs = self._library.names(self._container, "Input")
        self.outputs = self._library.names(self._container, "Output")
        self._threads = threads
        self._finalizer = weakref.finalize(
            self, PackageRunner._free, self._library, self._container, self._dir
        )

    @staticmethod
    def _free(
        library: AotiLibrary, container: Any, workdir: tempfile.TemporaryDirectory[str]
    ) -> None:
        library.delete(container)
        library.close()
        workdir.cleanup()

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = list(self.inputs)
        values = [inputs[n] for n in names] if set(inputs) == set(names) else list(inputs.values())
        if len(values) != len(names):
            raise ModelFileError(f"the package takes {len(names)} inputs, not {len(values)}")
        self._library.set_omp_threads(self._threads)
        arrays = [np.ascontiguousarray(v) for v in values]
        results = self._library.run_arrays(self._container, arrays, len(self.outputs))
        return {n: np.array(r) for n, r in zip(self.outputs, results, strict=True)}

    def close(self) -> None:
        self._finalizer()


def is_pt2_source(path: Path) -> bool:
    """A `.pt2` file holding an ExportedProgram, which model-archiver compiles."""
    return path.suffix.lower() == ".pt2" and is_exported_program(path)
