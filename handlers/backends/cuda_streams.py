"""How a model runs on a GPU: on a CUDA stream of the calling worker thread's own, and, with
`cuda_graphs: true` in the model's config, as CUDA graphs replayed instead of launched kernel by
kernel.

A stream per thread lets one worker's copies and kernels overlap another's on the same GPU (on
the default stream they would queue behind each other). Inputs reach the GPU from pinned host
memory with non-blocking copies on that stream.

A small batch spends most of its time launching kernels; a CUDA graph launches the whole call
at once (TensorRT's and Triton's answer to the same cost). A call is captured once per batch
size bucket (the powers of two up to the model's batch bound, and the bound itself) and per
shape of the other dimensions, on each worker thread (a graph replays into fixed buffers, so
two threads never share one), at most `MAX_GRAPHS` per thread. A batch is padded with zero
rows up to its bucket and the padding is cut from the outputs, as Triton's TensorRT backend
does: the model's rows must not depend on each other (true of classifiers, encoders, most
models served in batches; not of a model that normalizes across its batch). A graph replays the
kernels it recorded: a model whose work depends on its input values (control flow on a tensor's
contents, data-dependent shapes) must not use this switch. Batches larger than the largest
bucket run without a graph.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("scriptserve.handlers.cuda")

MAX_GRAPHS = 16
"""CUDA graphs kept per worker thread; further shapes run without one."""
DEFAULT_BOUND = 64
"""The largest bucket for a model whose batch has no bound of its own."""

Call = Callable[[list[torch.Tensor], int], list[torch.Tensor]]
"""A model call: input tensors on the device and the CUDA stream (its raw handle) to run on;
returns the output tensors on the device."""


def bucket_for(rows: int, bound: int | None) -> int | None:
    """The captured batch size that holds `rows`: the next power of two, or the bound when
    that is smaller; None when `rows` is more than the bound (no graph)."""
    limit = bound or DEFAULT_BOUND
    if rows > limit:
        return None
    size = 1
    while size < rows:
        size *= 2
    return min(size, limit)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


class CudaRunner:
    """Runs `call` for the worker threads of one model on one GPU (see the module)."""

    _capture_lock = threading.Lock()
    """One capture at a time in the process: a capture must not see another's allocations."""

    def __init__(
        self,
        call: Call,
        device: torch.device,
        graphs: bool,
        bound: int | None = None,
        capture: Call | None = None,
    ) -> None:
        self._call = call
        self.device = device
        self.graphs = graphs
        self.bound = bound
        self._capture = capture
        """The call to warm up and capture graphs with, where it is not `call`: an AOTInductor
        container's single-threaded run, which records no event (see pt2.py). Such a capture
        runs in CUDA's relaxed mode, which lets the runtime's own calls through."""
        self._local = threading.local()

    def _stream(self) -> torch.cuda.Stream:
        stream: torch.cuda.Stream | None = getattr(self._local, "stream", None)
        if stream is None:
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._local.stream = stream
            self._local.graphs = {}
        return stream

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs, on the host, for host `inputs` whose first dimension is the batch."""
        stream = self._stream()
        rows = inputs[0].shape[0] if inputs and inputs[0].dim() else 1
        size = bucket_for(rows, self.bound) if self.graphs else None
        with torch.cuda.stream(stream):
            graph = self._graph(size, inputs, stream) if size is not None else None
            if graph is None:
                on_device = [t.pin_memory().to(self.device, non_blocking=True) for t in inputs]
                outputs = self._call(on_device, stream.cuda_stream)
            else:
                for static, given in zip(graph.inputs, inputs, strict=True):
                    static[:rows].copy_(given.pin_memory(), non_blocking=True)
                    static[rows:].zero_()
                graph.graph.replay()
                outputs = [t[:rows] for t in graph.outputs]
            return [t.cpu() for t in outputs]  # waits for the stream

    def _graph(self, size: int, inputs: list[torch.Tensor], stream: Any) -> _Graph | None:
        graphs: dict[tuple[Any, ...], _Graph] = self._local.graphs
        key = (size, *((tuple(t.shape[1:]), t.dtype) for t in inputs))
        found = graphs.get(key)
        if found is not None or len(graphs) >= MAX_GRAPHS:
            return found
        with self._capture_lock:
            static = [
                torch.zeros((size, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in inputs
            ]
            call = self._capture or self._call
            for _ in range(2):  # lazy initialisation and autotuning happen outside the graph
                call(static, stream.cuda_stream)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            mode = "relaxed" if self._capture else "thread_local"
            with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
                outputs = call(static, stream.cuda_stream)
        log.info("captured a CUDA graph for batches of up to %d rows on %s", size, self.device)
        graphs[key] = made = _Graph(graph, static, outputs)
        return made

    def forget(self) -> None:
        """Drop this thread's graphs (the model they replay was replaced)."""
        if getattr(self._local, "graphs", None):
            self._local.graphs = {}
