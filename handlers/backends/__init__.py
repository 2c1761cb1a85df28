"""Model backends: load a `.pt2` package (AOTInductor), a TorchScript or an ONNX file onto a
device and run named-tensor batches.

All three release the GIL while the model runs, so N worker threads use N cores. Thread
counts are set explicitly (intra-op threads per call, one inter-op thread) so that
workers x intra-op threads stays within the cores the server was given.

>>> backend = load_backend(Path("model.onnx"), "onnx", device="cpu", intra_op_threads=1)
>>> backend.run({"x": np.ones((4, 8), np.float32)})["y"].shape
(4, 2)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from scriptserve.archiver.manifest import Manifest, ModelFormat
from scriptserve.archiver.model_file import ONNXRUNTIME_MISSING

log = logging.getLogger("scriptserve.handlers")


class BackendError(RuntimeError):
    """A model that fails to load or to run; the message says what failed."""

    status = 500


class InputRejected(BackendError):
    """Inputs the model cannot take (a sequence longer than it was exported for, say): the
    request's fault, answered 400 with the message."""

    status = 400


class ModelBackend(Protocol):
    """A loaded model. `run` is called from worker threads, concurrently."""

    device: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def parse_device(device: str) -> tuple[str, int]:
    """('cpu', 0) or ('cuda', N) from 'cpu' / 'cuda' / 'cuda:N'."""
    if device == "cpu":
        return "cpu", 0
    kind, _, index = device.partition(":")
    if kind == "cuda" and (not index or index.isdigit()):
        return "cuda", int(index or 0)
    raise BackendError(f"unknown device {device!r}; use 'cpu' or 'cuda:N'")


def wants_cuda_graphs(options: Mapping[str, Any]) -> bool:
    """Whether a model's config turns CUDA graphs on (`cuda_graphs: true`; cuda_streams.py)."""
    return str(options.get("cuda_graphs", "false")).strip().lower() in ("true", "1", "yes", "on")


def load_backend(
    path: Path,
    fmt: ModelFormat,
    device: str = "cpu",
    intra_op_threads: int = 1,
    options: Mapping[str, Any] | None = None,
    *,
    manifest: Manifest | None = None,
    workers: int = 1,
) -> ModelBackend:
    """Load a model file with the backend for its format.

    A `.pt2` model needs the archive's `manifest` (what it was compiled for, its signature and
    batch bound), and sizes its per-caller state for `workers` threads calling it at once.
    """
    kind, _ = parse_device(device)
    options = options or {}
    if kind == "cpu" and wants_cuda_graphs(options) and fmt != "onnx":
        log.info("cuda_graphs applies to models on GPUs: %s runs on the CPU without", path.name)
    if fmt == "pt2":
        from scriptserve.handlers.backends.pt2 import Pt2Backend

        return Pt2Backend(path, device, intra_op_threads, manifest, workers, options)
    if fmt == "onnx":
        try:
            from scriptserve.handlers.backends.onnx import OnnxBackend
        except ImportError as exc:
            if exc.name != "onnxruntime":
                raise
            raise BackendError(ONNXRUNTIME_MISSING) from None

        onnx = OnnxBackend(path, device, intra_op_threads, options)
        onnx.max_seq_len = _max_seq_len(manifest)
        return onnx
    from scriptserve.handlers.backends.torchscript import TorchScriptBackend

    torchscript = TorchScriptBackend(path, device, intra_op_threads, options)
    torchscript.max_seq_len = _max_seq_len(manifest)
    return torchscript


def _max_seq_len(manifest: Manifest | None) -> int | None:
    """The sequence bound the archive records for a TorchScript or ONNX model (a .pt2 reads its
    own): text handlers truncate to it."""
    section = manifest.scriptserve if manifest is not None else None
    return section.max_seq_len if section is not None else None
