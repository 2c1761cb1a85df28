"""TorchScript backend: `torch.jit.load` onto a device; the interpreter runs without the GIL.

On CUDA, each worker thread runs on a stream of its own, inputs go through pinned memory with
non-blocking copies, `precision: fp16` in the model config runs the model under fp16 autocast,
and `cuda_graphs: true` replays CUDA graphs of it (cuda_streams.py says when that is safe).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scriptserve.archiver.model_file import (
    ModelFileError,
    interpreter_message,
    name_torchscript_outputs,
)
from scriptserve.archiver.quantize import QuantizationError, select_engine
from scriptserve.handlers.backends import BackendError, parse_device, wants_cuda_graphs

_threads_lock = threading.Lock()
# Request tensors are decoded straight from the request's bytes, so they are read-only; torch
# warns once per process that its tensor may be written. The buffer belongs to that request
# alone, and a copy per request would cost more than the warning is worth.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def configure_threads(intra_op_threads: int) -> None:
    """Set torch's intra-op threads, and one inter-op thread where torch still allows it."""
    with _threads_lock:
        if torch.get_num_threads() != intra_op_threads:
            torch.set_num_threads(intra_op_threads)
        # Only settable before the first inter-op work; after that it is already fixed.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)


class TorchScriptBackend:
    def __init__(
        self, path: Path, device: str, intra_op_threads: int, options: Mapping[str, Any]
    ) -> None:
        kind, index = parse_device(device)
        if kind == "cuda" and not torch.cuda.is_available():
            raise BackendError(f"device {device} requested but CUDA is not available")
        self.device = device
        self.max_seq_len: int | None = None
        """The longest sequence the archive says the model takes (load_backend sets it)."""
        self._torch_device = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
        configure_threads(intra_op_threads)
        # Int8 models repack their weights for the quantized engine when loaded: the same
        # engine as at conversion (x86 / qnnpack). A torch without one still serves fp32.
        with contextlib.suppress(QuantizationError):
            select_engine()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(  # type: ignore[no-untyped-call]
                    str(path), map_location=self._torch_device
                )
        except Exception as exc:
            raise BackendError(f"the TorchScript model does not load: {exc}") from None
        self.module = module.eval()
        self.input_names = tuple(a.name for a in module.forward.schema.arguments[1:])
        self.output_names: tuple[str, ...] = ()
        fp16 = str(options.get("precision", "")).lower() == "fp16"
        self._autocast = kind == "cuda" and fp16
        self._names: tuple[str, ...] = ()
        if kind == "cuda":
            from scriptserve.handlers.backends.cuda_streams import CudaRunner

            graphs = wants_cuda_graphs(options)
            self._cuda = CudaRunner(self._call, self._torch_device, graphs)

    def _outputs(self, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        autocast = torch.autocast("cuda", dtype=torch.float16) if self._autocast else nullcontext()
        with torch.inference_mode(), autocast:
            return name_torchscript_outputs(self.module(*args))

    def _call(self, args: list[torch.Tensor], stream: int) -> list[torch.Tensor]:
        """A call on the GPU (the stream is already current): the outputs in name order."""
        outputs = self._outputs(args)
        self._names = tuple(outputs)
        return list(outputs.values())

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise BackendError(f"missing model input(s): {', '.join(missing)}")
        try:
            host = [torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in self.input_names]
            if self._torch_device.type == "cuda":
                # The names are read from the first call's outputs: after the run, not before.
                on_host = self._cuda.run(host)
                outputs = dict(zip(self._names, on_host, strict=True))
            else:
                outputs = self._outputs(host)
        except ModelFileError as exc:
            raise BackendError(str(exc)) from None
        except RuntimeError as exc:
            raise BackendError(f"the model failed: {interpreter_message(exc)}") from None
        result = {}
        for name, tensor in outputs.items():
            t = tensor.detach()
            if t.dtype in (torch.float16, torch.bfloat16):
                t = t.float()  # numpy has no bf16; fp16 autocast outputs go back as fp32
            result[name] = t.cpu().numpy()
        return result
