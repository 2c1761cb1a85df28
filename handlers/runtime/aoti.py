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
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

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
}
_SINGLE_THREADED = "AOTInductorModelContainerRunSingleThreaded"
"""A run on the container's first model instance that neither waits for nor records its
"finished" event: the run to capture a CUDA graph with (packages from torch 2.6 on)."""
_LAST_ERROR = "AOTInductorGetLastError"
"""The failed call's message; packages made by earlier torch releases (2.11) do not export it."""

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


# libtorch's tensor functions of the AOTInductor shim (aoti_torch/c/shim.h); AOTITorchError is
# int32_t, 0 on success. They are called without releasing the GIL (see `run_arrays`).
_i64_p = ctypes.POINTER(ctypes.c_int64)
_SHIM: dict[str, tuple[list[Any], Any]] = {
    "aoti_torch_create_tensor_from_blob": (
        [
            ctypes.c_void_p,  # data, borrowed
            ctypes.c_int64,  # ndim
            _i64_p,  # sizes
            _i64_p,  # strides, in elements
            ctypes.c_int64,  # storage offset
            ctypes.c_int32,  # dtype
            ctypes.c_int32,  # device type
            ctypes.c_int32,  # device index
            _handle_p,  # the new tensor handle
        ],
        ctypes.c_int32,
    ),
    "aoti_torch_delete_tensor_object": ([ctypes.c_void_p], ctypes.c_int32),
    "aoti_torch_get_data_ptr": ([ctypes.c_void_p, _handle_p], ctypes.c_int32),
    "aoti_torch_get_dim": ([ctypes.c_void_p, _i64_p], ctypes.c_int32),
    "aoti_torch_get_sizes": ([ctypes.c_void_p, ctypes.POINTER(_i64_p)], ctypes.c_int32),
    "aoti_torch_get_strides": ([ctypes.c_void_p, ctypes.POINTER(_i64_p)], ctypes.c_int32),
    "aoti_torch_get_dtype": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)], ctypes.c_int32),
    "aoti_torch_device_type_cpu": ([], ctypes.c_int32),
}
# numpy dtypes that cross as they are, by the name of the shim's dtype getter.
_NUMPY_DTYPES = {
    np.dtype(name if name != "bool" else np.bool_): name
    for name in (
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
}


class AotiError(RuntimeError):
    """A call into the compiled model failed; the message is the runtime's own."""


class _Output:
    """One output tensor's memory, as numpy arrays see it (`__array_interface__`): the tensor
    handle is deleted when the last array over it goes. The inputs stay alive with it, as an
    output may be a view of one."""

    __slots__ = ("__array_interface__", "_delete", "_handle", "_inputs")

    def __init__(
        self, interface: dict[str, Any], delete: Any, handle: int, inputs: list[np.ndarray]
    ) -> None:
        self.__array_interface__ = interface
        self._delete = delete
        self._handle = handle
        self._inputs = inputs

    def __del__(self) -> None:
        self._delete(self._handle)


_libtorch: ctypes.CDLL | None = None


def load_libtorch() -> None:
    """Make libtorch's C shim, which compiled models link against, resolvable, without
    `import torch` (most of a server's start: benchmarks/README.md): libtorch_cpu from the
    installed torch, loaded with RTLD_GLOBAL. Once torch is imported it is loaded already;
    importing torch later finds the same library."""
    global _libtorch  # noqa: PLW0603 - one load per process
    if _libtorch is not None or "torch" in sys.modules:
        return
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise AotiError("torch is not installed: compiled models need its libtorch")
    library = Path(spec.origin).parent / "lib" / "libtorch_cpu.so"
    if library.with_name("libtorch_cuda.so").exists():
        # A CUDA build: torch loads its CUDA libraries before libtorch_cpu, in an order of its
        # own; loading libtorch_cpu by hand first is not what its import does. The second
        # saved is not worth the difference on a GPU machine.
        import torch  # noqa: F401

        return
    try:
        _libtorch = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise AotiError(f"libtorch does not load: {exc}") from None


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


SHARED_CXX_RUNTIME = ":libstdc++.so.6"
"""The shared C++ runtime, as Inductor's `aot_inductor.custom_op_libs` names it for the linker
(`-l:libstdc++.so.6`): found by its file even where the compiler has no `libstdc++.so`."""

_LOCALE_CLASSIC = "_ZNSt6locale7classicEv"
"""std::locale::classic(), which every compiled model's runtime reaches (it parses the device
name with std::regex, which asks the locale's facets)."""


def _carries_its_own_cxx_runtime(lib: ctypes.CDLL, so: Path) -> bool:
    """Whether `lib` exports a C++ runtime of its own. Linked with libstdc++'s static archive (by
    a compiler that has no libstdc++.so, or given -static-libstdc++), a model's library holds a
    copy of libstdc++ whose exported symbols bind in part to the libstdc++ torch loaded: the two
    copies number std::locale's facets differently, and the runtime's first std::regex fails
    with std::bad_cast or jumps through the wrong facet's table (SIGSEGV, inside
    AOTInductorModelContainerCreateWithDevice). A private copy that exports nothing (linked
    with --exclude-libs) is not found here, and is harmless."""
    try:
        symbol = getattr(lib, _LOCALE_CLASSIC)
    except AttributeError:
        return False
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
    info = _DlInfo()
    if not dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return False
    return os.path.realpath(os.fsdecode(info.dli_fname)) == os.path.realpath(so)


class AotiLibrary:
    """A package's compiled model, loaded with ctypes.CDLL."""

    def __init__(self, so: Path) -> None:
        load_libtorch()
        try:
            self._lib = ctypes.CDLL(str(so))
        except OSError as exc:
            reason = str(exc).replace(f"{so.parent}/", "")  # not the server's private paths
            raise AotiError(f"the compiled model does not load: {reason}") from None
        if _carries_its_own_cxx_runtime(self._lib, so):
            self.close()
            raise AotiError(
                "the compiled model carries its own copy of the C++ runtime (its library was "
                "linked with libstdc++'s static archive, which a compiler without libstdc++.so "
                "or given -static-libstdc++ does): beside the runtime torch uses, it crashes on "
                "load. Build it again with this model-archiver, which links the shared runtime "
                "(a package compiled by hand: inductor_configs={'aot_inductor.custom_op_libs': "
                f"['{SHARED_CXX_RUNTIME}']}})"
            )
        for name, (argtypes, restype) in _ABI.items():
            try:
                function = getattr(self._lib, name)
            except AttributeError:
                raise AotiError(
                    f"the compiled model has no {name}: it was made by another torch release"
                ) from None
            function.argtypes = argtypes
            function.restype = restype
        self._single_threaded: Any = None
        with contextlib.suppress(AttributeError):
            self._single_threaded = getattr(self._lib, _SINGLE_THREADED)
            self._single_threaded.argtypes, self._single_threaded.restype = _ABI[
                "AOTInductorModelContainerRun"
            ]
        self._last_error: Any = None
        with contextlib.suppress(AttributeError):
            self._last_error = getattr(self._lib, _LAST_ERROR)
            self._last_error.argtypes, self._last_error.restype = [_name_p], ctypes.c_int32
        # The same library again, as a PyDLL: calls through it keep the GIL. Dropping it for
        # each small call would hand it to another thread and wait for it back.
        self._shim = ctypes.PyDLL(str(so), handle=self._lib._handle)
        for name, (argtypes, restype) in _SHIM.items():
            function = getattr(self._shim, name)
            function.argtypes = argtypes
            function.restype = restype
        self._cpu = self._shim.aoti_torch_device_type_cpu()
        self._codes: dict[np.dtype[Any], int] = {}
        for dtype, name in _NUMPY_DTYPES.items():
            getter = getattr(self._shim, f"aoti_torch_dtype_{name}")
            getter.argtypes, getter.restype = [], ctypes.c_int32
            self._codes[dtype] = getter()
        self._dtypes = {code: dtype for dtype, code in self._codes.items()}
        self._omp_set_num_threads: Any = None
        # dlsym through the model's own handle finds the OpenMP runtime its kernels call.
        with contextlib.suppress(AttributeError):
            self._omp_set_num_threads = self._lib.omp_set_num_threads
            self._omp_set_num_threads.argtypes = [ctypes.c_int]
            self._omp_set_num_threads.restype = None

    def _check(self, result: int, what: str) -> None:
        if result == 0:
            return
        if self._last_error is None:  # the runtime wrote its message to the server's stderr
            raise AotiError(f"the compiled model failed to {what} (its message is in the log)")
        message = ctypes.c_char_p()
        self._last_error(ctypes.byref(message))
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

    @property
    def runs_single_threaded(self) -> bool:
        """Whether the package has the single-threaded run (`run(single_threaded=True)`)."""
        return self._single_threaded is not None

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
        single_threaded: bool = False,
    ) -> list[torch.Tensor]:
        """Run the model on contiguous `inputs` (on the container's device); the GIL is
        released for the call. `single_threaded`: on the container's first model instance,
        without its "finished" event (which a CUDA graph capture must not record); only for a
        container that one thread alone calls."""
        import torch

        capsules = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)
        handles = (ctypes.c_void_p * len(capsules))(
            *(_capsule_pointer(c, _capsule_name(c)) for c in capsules)
        )
        results = (ctypes.c_void_p * outputs)()
        run = self._single_threaded if single_threaded else self._lib.AOTInductorModelContainerRun
        if run is None:
            raise AotiError(
                "the compiled model has no single-threaded run: it was made by a torch release "
                "before 2.6"
            )
        self._check(run(container, handles, len(capsules), results, outputs, stream, None), "run")
        return list(
            torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
                [_new_capsule(p, None, None) for p in results]
            )
        )

    def run_arrays(
        self, container: ctypes.c_void_p, inputs: list[np.ndarray], outputs: int
    ) -> list[np.ndarray]:
        """Run a CPU model on C-contiguous numpy `inputs`; the outputs are numpy arrays over the
        output tensors' memory. The GIL is released for the model's run and nowhere else:
        torch.from_numpy and Tensor.numpy() each drop and retake it, which under two busy
        threads is a wait for the other thread's Python."""
        shim = self._shim
        handles = (ctypes.c_void_p * len(inputs))()
        for i, array in enumerate(inputs):
            code = self._codes.get(array.dtype)
            if code is None:
                raise AotiError(f"numpy dtype {array.dtype} has no tensor dtype")
            sizes = (ctypes.c_int64 * array.ndim)(*array.shape)
            strides = (ctypes.c_int64 * array.ndim)(*(s // array.itemsize for s in array.strides))
            data = array.ctypes.data
            handle = ctypes.c_void_p()
            made = shim.aoti_torch_create_tensor_from_blob(
                data, array.ndim, sizes, strides, 0, code, self._cpu, 0, ctypes.byref(handle)
            )
            if made != 0:
                for done in handles[:i]:
                    shim.aoti_torch_delete_tensor_object(done)
                raise AotiError("the input tensors could not be made")
            handles[i] = handle.value
        results = (ctypes.c_void_p * outputs)()
        run = self._lib.AOTInductorModelContainerRun
        self._check(run(container, handles, len(inputs), results, outputs, None, None), "run")
        return [self._array(handle, inputs) for handle in results]

    def _array(self, handle: int | None, inputs: list[np.ndarray]) -> np.ndarray:
        """A numpy array over an output tensor, which it takes over."""
        shim = self._shim
        code, ndim, data = ctypes.c_int32(), ctypes.c_int64(), ctypes.c_void_p()
        sizes, strides = _i64_p(), _i64_p()
        shim.aoti_torch_get_dtype(handle, ctypes.byref(code))
        shim.aoti_torch_get_dim(handle, ctypes.byref(ndim))
        shim.aoti_torch_get_sizes(handle, ctypes.byref(sizes))
        shim.aoti_torch_get_strides(handle, ctypes.byref(strides))
        shim.aoti_torch_get_data_ptr(handle, ctypes.byref(data))
        dtype = self._dtypes.get(code.value)
        shape = tuple(sizes[d] for d in range(ndim.value))
        if dtype is None or not data.value:  # bf16 (numpy has none), or an empty tensor
            import torch

            (tensor,) = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
                [_new_capsule(handle, None, None)]
            )
            converted: np.ndarray = tensor.float().numpy() if dtype is None else tensor.numpy()
            return converted
        interface = {
            "version": 3,
            "typestr": dtype.str,
            "data": (data.value, False),
            "shape": shape,
            "strides": tuple(strides[d] * dtype.itemsize for d in range(ndim.value)),
        }
        owner = _Output(interface, shim.aoti_torch_delete_tensor_object, handle or 0, inputs)
        return np.asarray(owner)

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
