"""Requests and responses laid out in shared memory for worker processes.

A batch crosses to a worker process as two parts: the bytes (tensor data, request bodies,
multipart fields, response bodies) are copied once into a shared-memory segment, one after
another on 64-byte boundaries, and a small description (names, dtypes, shapes, offsets, request
ids, parameters) goes through the worker's pipe. Tensors never go through the pipe.

    frame = Frame()
    described = [describe_request(frame, r) for r in requests]
    segment = ensure_segment(segment, frame.size)
    frame.write(segment.buf)
    ...
    requests = [read_request(segment.buf, d) for d in described]
"""

from __future__ import annotations

import contextlib
import pickle
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from scriptserve.handlers.base import InferenceRequest, InferenceResponse

ALIGN = 64
MIN_SEGMENT_BYTES = 1 << 20

Span = tuple[int, int]
"""(offset, length) of one buffer in a segment."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Frame:
    """Buffers to be written into a segment, and where each one goes."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, memoryview]] = []
        self.size = 0

    def add(self, data: bytes | bytearray | memoryview | np.ndarray) -> Span:
        view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else data.data
        offset = self.size
        self._parts.append((offset, view))
        self.size = _aligned(offset + view.nbytes)
        return offset, view.nbytes

    def clear(self) -> None:
        """Forget every buffer added so far."""
        self._parts.clear()
        self.size = 0

    def write(self, buf: memoryview) -> None:
        for offset, view in self._parts:
            buf[offset : offset + view.nbytes] = view
        self._parts.clear()


def segment_view(segment: shared_memory.SharedMemory) -> memoryview:
    buf = segment.buf
    assert buf is not None, "the segment is closed"
    return buf


def ensure_segment(
    segment: shared_memory.SharedMemory | None, size: int
) -> shared_memory.SharedMemory:
    """`segment` if it holds `size` bytes, else a new one (at least twice as big); the old one
    is released and unlinked. Only the creating (server) side calls this."""
    if segment is not None and segment.size >= size:
        return segment
    wanted = max(MIN_SEGMENT_BYTES, size, 2 * segment.size if segment is not None else 0)
    if segment is not None:
        release_segment(segment)
    return shared_memory.SharedMemory(create=True, size=wanted)


def release_segment(segment: shared_memory.SharedMemory, unlink: bool = True) -> None:
    # BufferError: a view is still alive somewhere; the mapping goes with the process.
    with contextlib.suppress(BufferError):
        segment.close()
    if unlink:
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()


# -- arrays -------------------------------------------------------------------------------------
def describe_array(frame: Frame, array: np.ndarray) -> tuple[Any, ...]:
    array = np.asarray(array)
    if array.dtype.hasobject:  # BYTES tensors: numpy object arrays have no raw layout
        return ("pickle", *frame.add(pickle.dumps(array, protocol=5)))
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return ("raw", array.dtype.str, array.shape, *frame.add(flat))


def read_array(buf: memoryview, described: tuple[Any, ...]) -> np.ndarray:
    """A copy of the array (the segment is reused for the next batch)."""
    if described[0] == "pickle":
        _, offset, length = described
        array: np.ndarray = pickle.loads(buf[offset : offset + length])
        return array
    _, dtype, shape, offset, length = described
    if length == 0:
        return np.empty(shape, dtype=np.dtype(dtype))
    raw = np.frombuffer(buf, dtype=np.uint8, count=length, offset=offset)
    copy: np.ndarray = raw.view(np.dtype(dtype)).reshape(shape).copy()
    return copy


def read_bytes(buf: memoryview, span: Span) -> bytes:
    offset, length = span
    return bytes(buf[offset : offset + length])


# -- requests ----------------------------------------------------------------------------------
def describe_request(frame: Frame, request: InferenceRequest) -> dict[str, Any]:
    return {
        "id": request.request_id,
        "inputs": {name: describe_array(frame, a) for name, a in request.inputs.items()},
        "body": frame.add(request.body) if request.body is not None else None,
        "content_type": request.content_type,
        "fields": {name: frame.add(data) for name, data in request.fields.items()},
        "parameters": request.parameters,
        "headers": dict(request.headers),
        "kserve_instance": request.kserve_instance,
    }


def read_request(buf: memoryview, described: dict[str, Any]) -> InferenceRequest:
    body = described["body"]
    return InferenceRequest(
        inputs={name: read_array(buf, a) for name, a in described["inputs"].items()},
        body=read_bytes(buf, body) if body is not None else None,
        content_type=described["content_type"],
        fields={name: read_bytes(buf, span) for name, span in described["fields"].items()},
        parameters=described["parameters"],
        headers=described["headers"],
        request_id=described["id"],
        kserve_instance=described["kserve_instance"],
    )


# -- responses ---------------------------------------------------------------------------------
def describe_response(frame: Frame, response: InferenceResponse) -> dict[str, Any]:
    body: tuple[Any, ...] | None = None
    if isinstance(response.body, (bytes, bytearray)):
        body = ("bytes", *frame.add(response.body))
    elif response.body is not None:
        # JSON-like bodies (possibly holding numpy values), built by the handler in this process.
        body = ("pickle", *frame.add(pickle.dumps(response.body, protocol=5)))
    return {
        "outputs": {name: describe_array(frame, a) for name, a in response.outputs.items()},
        "body": body,
        "content_type": response.content_type,
        "error": response.error,
        "status": response.status,
        "final": response.final,
    }


def read_response(buf: memoryview, described: dict[str, Any]) -> InferenceResponse:
    body: Any = None
    if described["body"] is not None:
        kind, offset, length = described["body"]
        raw = buf[offset : offset + length]
        body = bytes(raw) if kind == "bytes" else pickle.loads(raw)
        raw.release()
    return InferenceResponse(
        outputs={name: read_array(buf, a) for name, a in described["outputs"].items()},
        body=body,
        content_type=described["content_type"],
        error=described["error"],
        status=described["status"],
        final=described["final"],
    )
