"""ONNX Runtime backend: one session per device, shared by the worker threads.

`InferenceSession.run` is thread-safe and releases the GIL. The session gets the worker's
intra-op thread count and one inter-op thread; on `cuda:N` it uses the CUDA provider for GPU N
with the CPU provider as fallback, and ahead of both TensorRT's provider when the server keeps a
TensorRT engine cache (`tensorrt_cache_dir`) and TensorRT is installed (`providers`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from scriptserve.archiver.model_file import ModelFileError, check_onnx_external_data
from scriptserve.handlers.backends import BackendError, parse_device

log = logging.getLogger("scriptserve.onnx")

TENSORRT_LIBRARIES = ("libnvinfer.so.10", "libnvinfer.so.8")


def tensorrt_installed() -> bool:
    """TensorRT's runtime can be loaded: from the system's libraries, or PyPI's `tensorrt`
    wheels. onnxruntime-gpu lists its TensorRT provider either way."""
    if importlib.util.find_spec("tensorrt_libs") is not None:
        return True
    for name in TENSORRT_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


def providers(
    device: str,
    available: Sequence[str],
    options: Mapping[str, Any],
    tensorrt: bool | None = None,
) -> list[Any]:
    """The execution providers of a session on `device`, in ONNX Runtime's order of preference.

    On `cuda:N`: TensorRT (engines cached in `options["tensorrt_cache_dir"]`) when that cache is
    set, the model's config does not say `tensorrt: false`, onnxruntime offers the provider and
    TensorRT is installed (`tensorrt`: whether it is, found out when None); then CUDA; then the
    CPU. Raises BackendError when onnxruntime has no CUDA provider (its CPU build)."""
    kind, index = parse_device(device)
    if kind != "cuda":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        raise BackendError(
            f"device {device} requested but onnxruntime has no CUDA provider: install "
            "'scriptserve[gpu]' (onnxruntime-gpu) in place of the CPU build"
        )
    chosen: list[Any] = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
    cache = options.get("tensorrt_cache_dir")
    wanted = cache is not None and str(options.get("tensorrt", "true")).lower() != "false"
    if wanted and cache is not None and "TensorrtExecutionProvider" in available:
        if tensorrt is None:
            tensorrt = tensorrt_installed()
        if tensorrt:
            Path(cache).mkdir(parents=True, exist_ok=True)
            settings = {
                "device_id": index,
                "trt_engine_cache_enable": True,
                "trt_engine_cache_path": str(cache),
                "trt_timing_cache_enable": True,
                "trt_timing_cache_path": str(cache),
            }
            chosen.insert(0, ("TensorrtExecutionProvider", settings))
        else:
            log.info("TensorRT is not installed: the ONNX model runs on CUDA without it")
    return chosen


class OnnxBackend:
    def __init__(
        self, path: Path, device: str, intra_op_threads: int, options: Mapping[str, Any]
    ) -> None:
        self.device = device
        self.max_seq_len: int | None = None
        """The longest sequence the archive says the model takes (load_backend sets it)."""
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Worker threads must not spin on cores other workers need.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        chosen = providers(device, ort.get_available_providers(), options)
        try:
            check_onnx_external_data(path)
            self.session = ort.InferenceSession(str(path), opts, providers=chosen)
        except ModelFileError as exc:
            raise BackendError(str(exc)) from None
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BackendError(f"the ONNX model does not load: {exc}") from None
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise BackendError(f"missing model input(s): {', '.join(missing)}")
        feed = {n: np.ascontiguousarray(inputs[n]) for n in self.input_names}
        try:
            results = self.session.run(None, feed)
        except Exception as exc:
            raise BackendError(f"the ONNX model failed: {exc}") from None
        return dict(zip(self.output_names, results, strict=True))
