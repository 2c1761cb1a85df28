"""The AOTInductor runtime's C ABI, called with ctypes: load a package's compiled `.so`, make
model containers, run them. A ctypes call releases the GIL for its whole duration, which
PyTorch's own runners do not (pytorch/pytorch#197516).

The functions are those of `torch/csrc/inductor/aoti_runtime/interface.h` in the installed
torch; each is declared with its argument and result types (undeclared, 64-bit pointers would
be truncated). Tensors cross as AtenTensorHandles: `run` makes new handles for the inputs
(the call takes them over and frees them) and takes over the output handles the call returns.

    library = AotiLibrary(Path("model.so"))
    container = library.create(models=2, device="cpu")
    (y,) = library.run(container, [torch.ones(4, 8)], outputs=1)
    library.delete(container)
    library.close()
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_handle_p = ctypes.POINTER(ctypes.c_void_p)
_size_p = ctypes.POINTER(ctypes.c_size_t)
_name_p = ctypes.POINTER(ctypes.c_char_p)

# name -> (argtypes, restype). AOTIRuntimeError is int32_t, 0 on success.
_ABI: dict[str, tuple[list[Any], Any]] = {
    "AOTInductorModelContainerCreateWithDevice": (
        [_handle_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p],
        ctypes.c_int32,
    ),
    "AOTInductorModelContainerDelete": ([ctypes.c_void_p], ctypes.c_int32),
    "AOTInductorModelContainerRun": (
        [
            ctypes.c_void_p,  # container
            _handle_p,  # input handles, stolen by the call
            ctypes.c_size_t,
            _handle_p,  # output handles, the caller's afterwards
            ctypes.c_size_t,
            ctypes.c_void_p,  # stream; NULL: the device's default
            ctypes.c_void_p,  # proxy executor; NULL: none
        ],
        ctypes.c_int32,
    ),
    "AOTInductorModelContainerGetNumInputs": ([ctypes.c_void_p, _size_p], ctypes.c_int32),
    "AOTInductorModelContainerGetInputName": (
        [ctypes.c_void_p, ctypes.c_size_t, _name_p],
        ctypes.c_int32,
    ),
    "AOTInductorModelContainerGetNumOutputs": ([ctypes.c_void_p, _size_p], ctypes.c_int32),
    "AOTInductorModelContainerGetOutputName": (
        [ctypes.c_void_p, ctypes.c_size_t, _name_p],
        ctypes.c_int32,
    ),
    "AOTInductorGetLastError": ([_name_p], ctypes.c_int32),
}

# AtenTensorHandles cross from and to torch as PyCapsules (torch._C._aoti).
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.argtypes = [ctypes.py_object]
_capsule_name.restype = ctypes.c_char_p
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer.restype = ctypes.c_void_p
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_new_capsule.restype = ctypes.py_object


class AotiError(RuntimeError):
    """A call into the compiled model failed; the message is the runtime's own."""


class AotiLibrary:
    """A package's compiled model, loaded with ctypes.CDLL."""

    def __init__(self, so: Path) -> None:
        try:
            self._lib = ctypes.CDLL(str(so))
        except OSError as exc:
            reason = str(exc).replace(f"{so.parent}/", "")  # not the server's private paths
            raise AotiError(f"the compiled model does not load: {reason}") from None
        for name, (argtypes, restype) in _ABI.items():
            try:
                function = getattr(self._lib, name)
            except AttributeError:
                raise AotiError(
                    f"the compiled model has no {name}: it was made by another torch release"
                ) from None
            function.argtypes = argtypes
            function.restype = restype
        self._omp_set_num_threads: Any = None
        # dlsym through the model's own handle finds the OpenMP runtime its kernels call.
        with contextlib.suppress(AttributeError):
            self._omp_set_num_threads = self._lib.omp_set_num_threads
            self._omp_set_num_threads.argtypes = [ctypes.c_int]
            self._omp_set_num_threads.restype = None

    def _check(self, result: int, what: str) -> None:
        if result == 0:
            return
        message = ctypes.c_char_p()
        self._lib.AOTInductorGetLastError(ctypes.byref(message))
        lines = (message.value or b"").decode(errors="replace").strip().splitlines()
        raise AotiError(f"the compiled model failed to {what}: {lines[0] if lines else '?'}")

    def create(self, models: int, device: str, cubin_dir: Path | None = None) -> ctypes.c_void_p:
        """A container of `models` model instances sharing one copy of the weights, on
        `device` ('cpu' or 'cuda:N'); `cubin_dir` holds a CUDA package's kernel files."""
        handle = ctypes.c_void_p()
        kernels = str(cubin_dir).encode() if cubin_dir is not None else None
        create = self._lib.AOTInductorModelContainerCreateWithDevice
        self._check(create(ctypes.byref(handle), models, device.encode(), kernels), "load")
        return handle

    def delete(self, container: ctypes.c_void_p) -> None:
        self._check(self._lib.AOTInductorModelContainerDelete(container), "unload")

    def names(self, container: ctypes.c_void_p, kind: str) -> tuple[str, ...]:
        """The model's input (`kind` "Input") or output ("Output") names, in order."""
        count = ctypes.c_size_t()
        number_of = getattr(self._lib, f"AOTInductorModelContainerGetNum{kind}s")
        self._check(number_of(container, ctypes.byref(count)), "describe itself")
        name_of = getattr(self._lib, f"AOTInductorModelContainerGet{kind}Name")
        names = []
        for i in range(count.value):
            name = ctypes.c_char_p()
            self._check(name_of(container, i, ctypes.byref(name)), "describe itself")
            names.append((name.value or b"").decode())
        return tuple(names)

    def run(
        self,
        container: ctypes.c_void_p,
        inputs: list[torch.Tensor],
        outputs: int,
        stream: int | None = None,
    ) -> list[torch.Tensor]:
        """Run the model on contiguous `inputs` (on the container's device); the GIL is
        released for the call."""
        import torch

        capsules = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)
        handles = (ctypes.c_void_p * len(capsules))(
            *(_capsule_pointer(c, _capsule_name(c)) for c in capsules)
        )
        results = (ctypes.c_void_p * outputs)()
        run = self._lib.AOTInductorModelContainerRun
        self._check(run(container, handles, len(capsules), results, outputs, stream, None), "run")
        return list(
            torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
                [_new_capsule(p, None, None) for p in results]
            )
        )

    def set_omp_threads(self, threads: int) -> None:
        """The calling thread's OpenMP thread count, for the kernels it runs from now on."""
        if self._omp_set_num_threads is not None:
            self._omp_set_num_threads(threads)

    def close(self) -> None:
        """Unmap the library (ctypes never does): once no container of it is left."""
        dlclose = getattr(ctypes.CDLL(None), "dlclose", None)
        if dlclose is not None:
            dlclose.argtypes = [ctypes.c_void_p]
            dlclose(self._lib._handle)
