"""AOTInductor backend: a `.pt2` package's compiled model, called through the AOTInductor
runtime's C ABI (handlers/runtime/aoti.py), which releases the GIL for the whole call.

PyTorch's own runners hold the GIL while the model runs (pytorch/pytorch#197516): a second
thread serves no more through them, and through the C ABI it does (benchmarks/README.md).

A package is refused at load, with what to do, when it was compiled with another torch
release, for another device, or for instructions this CPU lacks (the archive's manifest
records them). Its `.so` is extracted into a private directory: a directory archive is used in
place, and a file added beside its model would fail `verify`.

One container per backend (one backend per device) holds the weights once and `models` model
instances sharing them; a call takes a free instance, so calls run in parallel up to that
number and queue beyond it. It starts with the worker count the context announces; when more
threads call than there are instances (a pool scaled up later), a container with one instance
per calling thread replaces it, and the old one is deleted once its calls are done (until
then the weights are in memory twice).

On its first call, a thread sets its OpenMP thread count, which the generated kernels follow,
to the worker's intra-op threads. Inputs are checked against the archive's signature and the
exported batch bound before each call: the compiled code does not check them, and a wrong size
would make it read out of bounds.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scriptserve.archiver.manifest import Manifest, Pt2Info
from scriptserve.archiver.pt2_package import (
    Pt2Package,
    Pt2PackageError,
    compatibility_problem,
    read_package,
)
from scriptserve.handlers.backends import (
    BackendError,
    InputRejected,
    parse_device,
    wants_cuda_graphs,
)
from scriptserve.handlers.runtime.aoti import AotiError, AotiLibrary
from scriptserve.handlers.runtime.signature import SignatureError, datatype_of, numpy_dtype

if TYPE_CHECKING:  # torch is imported only for CUDA models
    from scriptserve.handlers.backends.cuda_streams import CudaRunner

log = logging.getLogger("scriptserve.handlers.pt2")


@dataclass(eq=False)
class _Container:
    """One model container; `calls` in flight; `retired` once a larger one took its place (it
    is deleted when its last call returns)."""

    handle: Any
    models: int
    calls: int = 0
    retired: bool = False


class _Callers:
    """The live threads that have called the backend. Each holds a token in a thread-local;
    when the thread ends, the token's finalizer gives its place back."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def join(self) -> object:
        with self._lock:
            self.count += 1
        token = _Token()
        weakref.finalize(token, self._leave)
        return token

    def _leave(self) -> None:
        with self._lock:
            self.count -= 1


class _Token:
    """A calling thread's place among the callers."""


def _free(library: AotiLibrary, lists: list[list[_Container]], workdir: Path) -> None:
    for containers in lists:
        for container in containers:
            try:
                library.delete(container.handle)
            except AotiError as exc:
                log.warning("a .pt2 model container did not unload cleanly: %s", exc)
        containers.clear()
    library.close()
    shutil.rmtree(workdir, ignore_errors=True)


def _servable(path: Path, device: str, manifest: Manifest | None) -> tuple[Pt2Package, Pt2Info]:
    """The package at `path` and its build record, or BackendError saying why this machine
    cannot serve it and what to do."""
    info = manifest.scriptserve.pt2 if manifest and manifest.scriptserve else None
    if manifest is None or info is None or not manifest.signature.inputs:
        raise BackendError(
            "the archive records no .pt2 build information (torch version, target, "
            "signature); rebuild it with model-archiver"
        )
    problem = compatibility_problem(info, device)
    if problem is not None:
        raise BackendError(problem)
    try:
        package = read_package(path)
    except Pt2PackageError as exc:
        raise BackendError(str(exc)) from None
    if package.device != info.target.device:
        raise BackendError(
            f"the archive records a .pt2 package for {info.target.device} and the package "
            f"is compiled for {package.device}; rebuild the archive with model-archiver"
        )
    if package.uses_proxy_executor():
        raise BackendError(
            "the .pt2 model calls operators through a proxy executor, which this backend "
            "does not provide; export it without custom operators"
        )
    return package, info


class Pt2Backend:
    def __init__(
        self,
        path: Path,
        device: str,
        intra_op_threads: int,
        manifest: Manifest | None,
        workers: int = 1,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        kind, index = parse_device(device)
        package, info = _servable(path, device, manifest)
        assert manifest is not None  # _servable refuses an archive without one
        self.device = device
        self._file = path.name
        self.max_batch = info.max_batch
        """The most rows one call may carry (the exported batch bound); None: no bound."""
        self.max_seq_len = info.max_seq_len
        """The most positions of a sequence input (dim 1 where the signature has -1 there);
        None: the model takes no sequence of varying length."""
        self._cuda = kind == "cuda"
        if self._cuda:  # on CPU, torch is never imported: the C ABI needs only libtorch
            import torch

            from scriptserve.handlers.backends.torchscript import configure_threads

            self._torch_device = torch.device(kind, index)
            configure_threads(intra_op_threads)
        self._threads = intra_op_threads
        self._signature = manifest.signature
        self._dtypes = [numpy_dtype(t.datatype) for t in self._signature.inputs]
        self._workdir = Path(tempfile.mkdtemp(prefix="scriptserve-pt2-"))
        self._containers: list[_Container] = []
        self._captures: list[_Container] = []
        """Each worker thread's container for CUDA graphs (`_capture_call`)."""
        try:
            self._library = AotiLibrary(package.extract(self._workdir))
        except (AotiError, Pt2PackageError) as exc:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise BackendError(f"the .pt2 model does not load: {exc}") from None
        self._finalizer = weakref.finalize(
            self, _free, self._library, [self._containers, self._captures], self._workdir
        )
        try:
            self._containers.append(self._create(max(1, workers)))
            handle = self._containers[0].handle
            takes = len(self._library.names(handle, "Input"))
            outputs = self._library.names(handle, "Output")
        except AotiError as exc:
            self.close()
            raise BackendError(str(exc)) from None
        # The compiled model numbers its inputs (arg0_1, ...); the signature names them, in
        # the same order.
        self.input_names = tuple(t.name for t in self._signature.inputs)
        if takes != len(self.input_names):
            self.close()
            raise BackendError(
                f"the archive's signature has {len(self.input_names)} inputs and the .pt2 "
                f"model takes {takes}; rebuild the archive"
            )
        named = tuple(t.name for t in manifest.signature.outputs)
        self.output_names = named if len(named) == len(outputs) else outputs
        self._lock = threading.Lock()
        self._grow_lock = threading.Lock()
        self._callers = _Callers()
        self._local = threading.local()
        if self._cuda:
            self._cuda_runner = self._runner(options or {})

    def _runner(self, options: Mapping[str, Any]) -> CudaRunner:
        from scriptserve.handlers.backends.cuda_streams import CudaRunner

        graphs = wants_cuda_graphs(options)
        if graphs and not self._library.runs_single_threaded:
            self.close()
            raise BackendError(
                "cuda_graphs needs a .pt2 package from torch 2.6 or later (its "
                "single-threaded run); rebuild the archive or turn cuda_graphs off"
            )
        return CudaRunner(
            self._call_container,
            self._torch_device,
            graphs,
            self.max_batch,
            capture=self._capture_call,
        )

    @property
    def models(self) -> int:
        """Model instances in the current container: how many calls can run at once."""
        return self._containers[-1].models

    def close(self) -> None:
        """Free the model now rather than when the backend is collected."""
        self._finalizer()

    # -- containers -------------------------------------------------------------------------
    def _create(self, models: int) -> _Container:
        cuda = self._cuda
        handle = self._library.create(
            models, str(self._torch_device) if cuda else "cpu", self._workdir if cuda else None
        )
        return _Container(handle, models)

    def _grow(self) -> None:
        """Replace the container with one that has an instance for every calling thread."""
        with self._grow_lock:
            wanted = self._callers.count
            if wanted <= self.models:
                return
            log.info(
                "%d threads call the .pt2 model %s on %s: loading a container of %d model "
                "instances in place of one of %d",
                wanted,
                self._file,
                self.device,
                wanted,
                self.models,
            )
            try:
                new = self._create(wanted)
            except AotiError as exc:
                raise BackendError(str(exc)) from None
            with self._lock:
                old = self._containers[-1]
                self._containers.append(new)
                old.retired = True
                if old.calls == 0:
                    self._delete(old)

    def _delete(self, container: _Container) -> None:
        """With `_lock` held: delete a retired container that nobody is calling."""
        self._containers.remove(container)
        self._library.delete(container.handle)

    # -- a call -----------------------------------------------------------------------------
    def _enter_thread(self) -> None:
        """On a thread's first call: its OpenMP threads, and its place among the callers."""
        if getattr(self._local, "token", None) is not None:
            return
        torch = sys.modules.get("torch")
        if torch is not None:
            # torch's own lazy per-thread OpenMP set-up runs first, so that it cannot undo ours.
            torch.get_num_threads()
        self._library.set_omp_threads(self._threads)
        self._local.token = self._callers.join()
        if self._callers.count > self.models:
            self._grow()

    def _check(self, arrays: list[np.ndarray]) -> None:
        rows = set()
        for spec, dtype, array in zip(self._signature.inputs, self._dtypes, arrays, strict=True):
            if array.dtype != dtype:
                try:
                    got = datatype_of(array.dtype)
                except SignatureError:
                    got = str(array.dtype)
                raise BackendError(
                    f"input {spec.name!r} has datatype {got}; the model takes {spec.datatype}"
                )
            if not spec.accepts_shape(array.shape):
                raise BackendError(
                    f"input {spec.name!r} has shape {list(array.shape)}; the model takes "
                    f"{list(spec.shape)} (-1 = any size)"
                )
            rows.add(array.shape[0] if array.ndim else 1)
            if self.max_seq_len is not None and len(spec.shape) > 1 and spec.shape[1] == -1:
                length = array.shape[1]
                if not 1 <= length <= self.max_seq_len:
                    raise InputRejected(
                        f"input {spec.name!r} has {length} positions; the .pt2 model takes 1 "
                        f"to {self.max_seq_len} (its --max-seq-len): send shorter sequences"
                    )
        if len(rows) != 1:
            raise BackendError("every input needs the same number of rows (dim 0)")
        batch = rows.pop()
        if batch < 1:
            raise BackendError("a batch needs at least one row")
        if self.max_batch is not None and batch > self.max_batch:
            raise BackendError(
                f"a batch of {batch} rows is more than the {self.max_batch} the .pt2 model was "
                f"exported for; send at most {self.max_batch} rows at once, or rebuild the "
                "archive with a larger --max-batch"
            )

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise BackendError(f"missing model input(s): {', '.join(missing)}")
        arrays = [np.ascontiguousarray(inputs[n]) for n in self.input_names]
        self._check(arrays)
        self._enter_thread()
        with self._lock:
            container = self._containers[-1]
            container.calls += 1
        try:
            if self._cuda:
                outputs = self._run_cuda(container, arrays)
            else:
                outputs = self._library.run_arrays(container.handle, arrays, len(self.output_names))
        except AotiError as exc:
            raise BackendError(str(exc)) from None
        finally:
            with self._lock:
                container.calls -= 1
                if container.retired and container.calls == 0:
                    self._delete(container)
        return dict(zip(self.output_names, outputs, strict=True))

    def _run_cuda(self, container: _Container, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """On this thread's CUDA stream, through its CUDA graphs when the model's config asks
        for them (cuda_streams.py); graphs made with a container that was replaced since are
        made again."""
        import torch

        if getattr(self._local, "graphed", None) is not container:
            self._cuda_runner.forget()
            self._local.graphed = container
        self._local.container = container
        outputs = self._cuda_runner.run([torch.from_numpy(a) for a in arrays])
        # numpy has no bf16
        return [(t.float() if t.dtype == torch.bfloat16 else t).numpy() for t in outputs]

    def _call_container(self, tensors: list[Any], stream: int) -> list[Any]:
        handle = self._local.container.handle
        return self._library.run(handle, tensors, len(self.output_names), stream)

    def _capture_call(self, tensors: list[Any], stream: int) -> list[Any]:
        """A call to capture a CUDA graph with: on this thread's own one-model container, run
        single-threaded. A shared container's run waits for and records its model's
        "finished" event, and an event recorded inside a capture fails every later wait for
        it. The graphs hold this container's weights, so it lives as long as the backend."""
        container: _Container | None = getattr(self._local, "capture", None)
        if container is None:
            try:
                container = self._create(1)
            except AotiError as exc:
                raise BackendError(str(exc)) from None
            with self._lock:
                self._captures.append(container)
            self._local.capture = container
        return self._library.run(
            container.handle, tensors, len(self.output_names), stream, single_threaded=True
        )
