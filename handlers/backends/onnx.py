"""ONNX Runtime backend: one session per device, shared by the worker threads.

`InferenceSession.run` is thread-safe and releases the GIL. The session gets the worker's
intra-op thread count and one inter-op thread; on `cuda:N` it uses the CUDA provider for GPU N
with the CPU provider as fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from scriptserve.archiver.model_file import ModelFileError, check_onnx_external_data
from scriptserve.handlers.backends import BackendError, parse_device


class OnnxBackend:
    def __init__(
        self, path: Path, device: str, intra_op_threads: int, options: Mapping[str, Any]
    ) -> None:
        kind, index = parse_device(device)
        self.device = device
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Worker threads must not spin on cores other workers need.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers: list[Any] = ["CPUExecutionProvider"]
        if kind == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BackendError(
                    f"device {device} requested but onnxruntime has no CUDA provider"
                )
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": index}))
        try:
            check_onnx_external_data(path)
            self.session = ort.InferenceSession(str(path), opts, providers=providers)
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
