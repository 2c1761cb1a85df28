"""Raw tensor bytes as the Open Inference Protocol sends them, over REST and gRPC alike.

Little-endian, row-major, no strides; a BYTES element is a 4-byte little-endian length followed
by its bytes.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from scriptserve.archiver.signature import SignatureError, datatype_of, numpy_dtype
from scriptserve.server.errors import InvalidInput


def tensor_dtype(name: str, datatype: str) -> np.dtype[Any]:
    """The numpy dtype for an input's datatype, or InvalidInput naming the input."""
    if datatype == "BF16":
        raise InvalidInput(f"input {name!r}: BF16 is not supported; send FP32 or FP16")
    try:
        return numpy_dtype(datatype)
    except SignatureError as exc:
        raise InvalidInput(f"input {name!r}: {exc}") from None


def decode_raw(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    """One input from its raw bytes; the size must match shape and datatype exactly."""
    count = math.prod(shape)
    dtype = tensor_dtype(name, datatype)
    if datatype == "BYTES":
        items: list[bytes] = []
        pos = 0
        while pos < len(raw):
            if pos + 4 > len(raw):
                raise InvalidInput(f"input {name!r}: truncated BYTES element length")
            (length,) = struct.unpack_from("<I", raw, pos)
            pos += 4
            items.append(raw[pos : pos + length])
            pos += length
        if len(items) != count or pos != len(raw):
            raise InvalidInput(f"input {name!r}: shape {shape} needs {count} BYTES elements")
        return np.array(items, dtype=np.object_).reshape(shape)
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(
            f"input {name!r}: shape {shape} of {datatype} needs {count * dtype.itemsize} bytes, "
            f"got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape)


def encode_raw(array: np.ndarray) -> bytes:
    """An output's raw bytes."""
    if datatype_of(array.dtype) == "BYTES":
        parts = []
        for item in array.ravel():
            data = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
