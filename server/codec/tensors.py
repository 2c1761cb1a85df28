"""Tensors as the Open Inference Protocol sends them, over REST and gRPC alike.

An input arrives as a name, a datatype, a shape and either values (JSON lists, gRPC typed
contents) or raw bytes (the binary extension, gRPC raw contents). Raw bytes are little-endian,
row-major, no strides; a BYTES element is a 4-byte little-endian length followed by its bytes.
Every check on a tensor a client sent is made here, once, with a message naming the input.

>>> from_values("x", "FP32", [1, 2], [[1.0, 2.0]]).shape
(1, 2)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from scriptserve.handlers.runtime.json_numbers import JsonArray
from scriptserve.handlers.runtime.signature import (
    BYTES_KINDS,
    SignatureError,
    datatype_of,
    numpy_dtype,
)
from scriptserve.server.errors import InvalidInput


def tensor_dtype(name: str, datatype: str) -> np.dtype[Any]:
    """The numpy dtype for an input's datatype, or InvalidInput naming the input."""
    if datatype == "BF16":
        raise InvalidInput(f"input {name!r}: BF16 is not supported; send FP32 or FP16")
    try:
        return numpy_dtype(datatype)
    except SignatureError as exc:
        raise InvalidInput(f"input {name!r}: {exc}") from None


MAX_RANK = 32
"""Most dimensions a tensor may have (numpy's own limit before 2.0)."""
MAX_DIMENSION = 2**31 - 1
"""Largest size of one dimension. A shape is checked before anything is allocated for it, and
every element must then arrive as bytes or values, so this bounds what numpy is asked to describe
(a zero-sized [0, 2**63-1] is otherwise a ValueError deep in numpy), not what is allocated."""


def check_shape(name: str, shape: Any) -> list[int]:
    """The shape as a list of non-negative integers within the bounds (a JSON `true` is not a
    dimension)."""
    if type(shape) is list and len(shape) <= MAX_RANK:
        # What JSON gives: checked without the ABC's isinstance and a generator per dimension.
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_DIMENSION:
                break
        else:
            return shape
    if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)):
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of non-negative integers")
    dims = list(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of non-negative integers")
    if len(dims) > MAX_RANK:
        raise InvalidInput(f"input {name!r}: {len(dims)} dimensions; at most {MAX_RANK}")
    if any(d > MAX_DIMENSION for d in dims):
        raise InvalidInput(f"input {name!r}: a dimension is larger than {MAX_DIMENSION}")
    return dims


def decode_raw(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    """One input from its raw bytes; the size must match shape and datatype exactly."""
    count = math.prod(shape)
    dtype = tensor_dtype(name, datatype)
    if datatype == "BYTES":
        if count * 4 > len(raw):  # every element is at least its 4-byte length
            raise InvalidInput(
                f"input {name!r}: shape {shape} needs {count} BYTES elements; "
                f"{len(raw)} bytes cannot hold them"
            )
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


def _flat(values: Any) -> Iterator[Any]:
    """Elements in row-major order from nested JSON lists or a protobuf repeated field."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        yield values
    else:
        for value in values:
            yield from _flat(value)


def _element(name: str, value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes):
        return value
    raise InvalidInput(f"input {name!r}: a BYTES element must be a string")


def from_values(name: str, datatype: str, shape: list[int], values: Any) -> np.ndarray:
    """One input from its values (nested JSON lists, a JsonArray or a flat sequence), in
    row-major order."""
    dtype = tensor_dtype(name, datatype)
    count = math.prod(shape)
    if isinstance(values, JsonArray):
        array = values.to_numpy(dtype)
        values = values.to_list() if array is None else array
    try:
        if datatype == "BYTES":
            items = [_element(name, v) for v in _flat(values)]
            flat = np.empty(len(items), dtype=np.object_)
            flat[:] = items
        else:
            flat = np.asarray(values, dtype=dtype).ravel()
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: data is not a valid {datatype} array: {exc}") from None
    if flat.size != count:
        raise InvalidInput(f"input {name!r}: shape {shape} needs {count} values, got {flat.size}")
    return flat.reshape(shape)


def add_input(inputs: dict[str, np.ndarray], name: str, array: np.ndarray) -> None:
    """Add one decoded input; a name sent twice is the client's mistake."""
    if name in inputs:
        raise InvalidInput(f"input {name!r} appears twice")
    inputs[name] = array


def raw_output(array: np.ndarray) -> tuple[str, bytes]:
    """An output's datatype and raw bytes (gRPC's `raw_output_contents`)."""
    raw = encode_raw(array)
    return datatype_of(array.dtype), raw


def encode_raw(array: np.ndarray) -> bytes:
    """An output's raw bytes: BYTES elements (bytes, str or objects) length-prefixed."""
    if array.dtype.kind in BYTES_KINDS:
        parts = []
        for item in array.ravel():
            data = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
