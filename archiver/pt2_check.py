"""Checking `.pt2` packages at archive time, and running them in this process, through the same
C ABI the server uses (handlers/runtime/aoti.py).

`check_package` refuses a package the server could not serve (proxy-executor calls, a fixed
batch, another device), runs the sample with the generated code's input checks on, and
describes it: the signature from that run, and the build record the manifest keeps.
`check_at_bound` runs a package we exported at its full batch bound against the model.
`PackageRunner` runs a CPU package repeatedly, for measuring (int8 reports, training, benchmarks).

    build = check_package(Path("model.pt2"), {"x": sample}, max_batch=None)
    build.signature, build.info.max_batch
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scriptserve.archiver.manifest import Pt2Info
from scriptserve.archiver.model_file import ModelFileError
from scriptserve.archiver.pt2_package import (
    Pt2Package,
    Pt2PackageError,
    package_target,
    read_package,
)
from scriptserve.handlers.runtime.aoti import AotiError, AotiLibrary
from scriptserve.handlers.runtime.signature import Signature, TensorSpec, datatype_of


@dataclass(frozen=True)
class Pt2Build:
    """A checked package: what the manifest records about it, and a line for the user."""

    package: Path
    info: Pt2Info
    signature: Signature
    report: str = ""
    max_abs_diff: float | None = field(default=None, compare=False)


def call_model(model: Any, named: Mapping[str, np.ndarray], device: str = "cpu") -> Any:
    """`model` on the named arrays: an eager model by keyword, as model-archiver exports it
    (arrays named generically, `input0`..., as a sample in a JSON list is, in order: forward's
    arguments, as `pt2_export.export_model` binds them); an exported program's module (a
    GraphModule) in order, as it was exported."""
    import torch

    tensors = {n: torch.from_numpy(np.ascontiguousarray(a)).to(device) for n, a in named.items()}
    if isinstance(model, torch.fx.GraphModule):
        return model(*tensors.values())
    if not tensors.keys() <= inspect.signature(model.forward).parameters.keys():
        return model(*tensors.values())
    return model(**tensors)


def model_outputs(
    model: Any, named: Mapping[str, np.ndarray], device: str = "cpu"
) -> list[np.ndarray]:
    """`model`'s outputs on the named arrays (`call_model`, without autograd), as numpy arrays
    in order: what a compiled package's answer is checked against."""
    import torch
    from torch.utils._pytree import tree_leaves

    with torch.no_grad():
        expected = call_model(model, named, device)
    return [t.detach().cpu().numpy() for t in tree_leaves(expected)]


REDUCED_AT_BOUND = 0.05
"""How far, relative to the outputs' norm, a reduced-precision package may answer from the
eager model in the same precision at its batch bound (`check_at_bound`)."""


def check_at_bound(
    path: Path,
    model: Any,
    sample: Mapping[str, np.ndarray],
    bound: int,
    device: str,
    seq: tuple[Collection[str], int] | None = None,
    reduced: bool = False,
) -> None:
    """Run the package on `bound` rows and compare with the model. Inductor may write a lower
    bound into the generated input check than the exported one (15 for a small CNN exported
    for 64, whose outputs are right at 64): the exported bound is the one served, so it is
    checked here. With `seq` (the sequence inputs and their bound), the rows are that long too:
    the sample's positions repeated.

    The package and the model agree to 1e-3 of the largest output in fp32. In `reduced`
    precision (bf16, fp16: both run it) they round differently at every layer, so what is
    asked is that the difference stays a rounding one: at most `REDUCED_AT_BOUND` of the
    outputs' norm (ResNet-50 in bf16: 0.0096, while each is 0.008-0.009 from fp32), where a
    wrong kernel at the bound is off by the order of the outputs themselves. How close bf16
    is to fp32 is the accuracy guard's to judge (archiver/precision.py)."""
    import torch
    from torch.utils._pytree import tree_leaves

    rng = np.random.default_rng(0)
    rows = {}
    for name, array in sample.items():
        tiled = np.repeat(array[:1], bound, axis=0)
        if seq is not None and name in seq[0]:
            repeats = -(-seq[1] // tiled.shape[1])
            tiled = np.concatenate([tiled] * repeats, axis=1)[:, : seq[1]]
        if array.dtype.kind == "f":  # rows that differ, around the sample's
            tiled += (rng.standard_normal(tiled.shape) * 0.1).astype(array.dtype)
        rows[name] = np.ascontiguousarray(tiled)
    package = read_package(path)
    what = f"a batch of {bound} rows" + (f" of {seq[1]} positions" if seq else "")
    try:
        _, outputs = run_package(package, device, list(rows.values()), input_checks=False)
    except AotiError as exc:
        raise ModelFileError(f"{path.name} failed on {what}: {exc}") from None
    with torch.no_grad():
        expected = call_model(model, rows, device)
    for got, want in zip(outputs, tree_leaves(expected), strict=True):
        want_np = want.detach().float().cpu().numpy()
        if reduced:
            norm = float(np.linalg.norm(want_np))
            diff = float(np.linalg.norm(got - want_np)) / norm if norm else 0.0
            agrees = diff <= REDUCED_AT_BOUND
        else:
            diff = float(np.max(np.abs(got - want_np))) if got.size else 0.0
            scale = max(1.0, float(np.max(np.abs(want_np)))) if want_np.size else 1.0
            agrees = diff <= 1e-3 * scale
        if not agrees:
            lower = "--max-seq-len" if seq else "--max-batch"
            by = f"{diff:.3g} of its outputs' norm" if reduced else f"{diff:.3g}"
            raise ModelFileError(
                f"{path.name} differs from the model by {by} on {what}; export it with a "
                f"lower {lower}"
            )


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


def run_package(
    package: Pt2Package, device: str, inputs: list[np.ndarray], input_checks: bool = True
) -> tuple[tuple[str, ...], list[np.ndarray]]:
    """(output names, outputs) of one run of the package on `inputs`, in the model's order, in
    a container made for it."""
    with opened_package(package, device, input_checks) as run:
        return run(inputs)


Run = Callable[[list[np.ndarray]], tuple[tuple[str, ...], list[np.ndarray]]]


@contextlib.contextmanager
def opened_package(package: Pt2Package, device: str, input_checks: bool = True) -> Iterator[Run]:
    """The package loaded once, in a container of one model instance on `device`, for as many
    runs as the caller makes (the accuracy guard runs every validation sample): each run gives
    (output names, outputs) in the model's order."""
    import torch

    with tempfile.TemporaryDirectory(prefix="scriptserve-pt2-") as tmp:
        library = AotiLibrary(package.extract(Path(tmp)))
        cuda = device.startswith("cuda")
        container = library.create(1, device, Path(tmp) if cuda else None)

        def run(inputs: list[np.ndarray]) -> tuple[tuple[str, ...], list[np.ndarray]]:
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
            arrays = [
                (t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()
                for t in results
            ]
            return names, arrays

        try:
            yield run
        finally:
            library.delete(container)
            library.close()


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
        names, outputs = run_package(package, device, inputs)
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
        tuple(
            TensorSpec(n, datatype_of(a.dtype), (-1, *a.shape[1:]))
            for n, a in zip(names, outputs, strict=True)
        ),
    )
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
