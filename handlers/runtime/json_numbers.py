"""JSON arrays of numbers read straight into numpy, without a Python number per element.

`orjson.loads` makes a Python float of every number and `np.asarray` then reads them back one by
one, all of it holding the GIL. simdjson (pysimdjson) parses the same text and hands the numbers
over as one flat buffer of doubles, in well under half the time (benchmarks/README.md).
This is where a JSON tensor is decoded: a `/predictions` body (`signature.arrays_from_text`) and
the `data` of an Open Inference Protocol input (the REST codec).

Only what can be read exactly is read this way: a rectangular array of numbers for a float
tensor, or of integers within range for an integer tensor. Anything else (strings, booleans,
ragged or mixed nesting, a number out of range) is answered `None`, and the caller takes its
general path, which keeps its own results and messages; text that is not valid JSON is handed to
orjson for the same reason.

>>> array_from_text(b"[[1, 2], [3, 4]]", np.dtype("float32")).shape
(2, 2)
>>> loads(b'{"data": [1, 2]}', lazy_key="data")["data"].to_numpy(np.dtype("int64"))
array([1, 2])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import orjson
import simdjson

_FAILURES = (ValueError, TypeError, RuntimeError)
"""What pysimdjson raises for text it cannot parse or a buffer it cannot make (a UTF-8 error is
a ValueError too)."""
_MAX_RANK = 32
"""Deepest nesting read here (numpy's own limit before 2.0): a deeper text is left to the
general path, which refuses it, rather than walked by recursion."""
_WHITESPACE = b" \t\n\r"
"""JSON's whitespace (bytes.strip would take vertical tabs and form feeds too)."""
_OBJECT = simdjson.Object
_ARRAY = simdjson.Array
_BufferType = Literal["d", "i", "u"]
_BUFFER_TYPES: dict[str, _BufferType] = {"f": "d", "i": "i", "u": "u"}
"""numpy dtype kind -> pysimdjson's buffer element: doubles, int64, uint64."""
_BUFFER_DTYPES: dict[_BufferType, np.dtype[Any]] = {
    "d": np.dtype(np.float64),
    "i": np.dtype(np.int64),
    "u": np.dtype(np.uint64),
}


class JsonArray:
    """A JSON array left unconverted by `loads`: read it as a numpy array or as Python lists."""

    __slots__ = ("_array", "_shape")

    def __init__(self, array: simdjson.Array, shape: tuple[int, ...] | None) -> None:
        self._array = array
        self._shape = shape
        """Its rectangular shape, or None when it has none (or it could not be made sure of)."""

    def to_numpy(self, dtype: np.dtype[Any]) -> np.ndarray | None:
        """The array with its nested shape, or None when it cannot be read exactly as `dtype`."""
        return None if self._shape is None else _read(self._array, self._shape, dtype)

    def to_list(self) -> list[Any]:
        """The array as `json.loads` would give it."""
        return self._array.as_list()


def array_from_text(text: bytes, dtype: np.dtype[Any]) -> np.ndarray | None:
    """The JSON text's top-level array as `dtype` (a float or integer dtype), with its nested
    shape; None when the text is anything else or is not valid JSON (the caller's general path
    then says what is wrong)."""
    return _array(text, dtype, None)


def _array(text: bytes, dtype: np.dtype[Any], arrays: int | None) -> np.ndarray | None:
    """`array_from_text`, given the count of `[` in the text when the caller knows it."""
    try:
        document = simdjson.Parser().parse(text)
    except _FAILURES:
        return None
    if not isinstance(document, simdjson.Array):
        return None
    shape = _shape(document)
    if shape is None:
        return None
    if (text.count(b"[") if arrays is None else arrays) != _arrays_in(shape):
        return None
    return _read(document, shape, dtype)


def rows_from_texts(texts: Sequence[bytes], dtype: np.dtype[Any]) -> np.ndarray | None:
    """Texts that are each one flat JSON array of numbers, all of one length, read in one parse
    as the rows of one (len(texts), length) array of `dtype`; None when any text is anything
    else (the caller then reads each text on its own, with its own result or error).

    The texts are joined by commas inside one more array. Each must begin with its only `[` and
    end with `]` (JSON whitespace aside), and what is read must be as many rows as texts, each a
    flat run of numbers: then the only brackets are the outer pair and each row's own pair, each
    text holds one `]` too (the one it ends with), and row i is text i, so no text lends numbers
    to another's row. A text with nested arrays (an instance of more than one dimension) is
    turned away by its count of `[` before anything is parsed. One parse for a batch costs about
    half of one parse per text.

    >>> rows_from_texts([b"[1, 2]", b" [3, 4]\\n"], np.dtype("float32")).tolist()
    [[1.0, 2.0], [3.0, 4.0]]
    >>> rows_from_texts([b"[1, 2", b"3], [4, 5, 6]"], np.dtype("float32")) is None
    True
    """
    rows: list[bytes] = []
    for text in texts:
        row = text.strip(_WHITESPACE)
        if row[:1] != b"[" or row[-1:] != b"]" or row.count(b"[") != 1:
            return None
        rows.append(row)
    # One `[` in each text and the one around them: the joined text is not counted again.
    array = _array(b"[%s]" % b",".join(rows), dtype, len(rows) + 1)
    if array is None or array.ndim != 2 or array.shape[0] != len(rows):
        return None
    return array


def loads(text: bytes, lazy_key: str) -> Any:
    """The JSON text as `orjson.loads` gives it, except that an array under the key `lazy_key`
    (at any depth) is a `JsonArray`. Invalid text raises `orjson.JSONDecodeError`, with
    orjson's own message.

    A text in which the key is not written as it is (an OIP binary request's JSON header, which
    carries no `data`) is orjson's alone: walking simdjson's values in Python costs about ten
    times orjson's parse of such a small header. A key written with escapes is read that way
    too, as a list, which the caller's general path takes."""
    if b'"%s"' % lazy_key.encode() not in text:
        return orjson.loads(text)
    try:
        document = simdjson.Parser().parse(text)
    except _FAILURES:
        return orjson.loads(text)  # raises, with orjson's message
    walk = _Walk(lazy_key)
    try:
        value = walk.python(document)
    except _RepeatedKey:
        return orjson.loads(text)  # orjson keeps a repeated key's last value
    except RecursionError:
        return orjson.loads(text)  # nested deeper than Python recurses: orjson's answer
    if text.count(b"[") != walk.arrays:
        # An array nested where a lazy array's shape has numbers (or a "[" inside a string):
        # the lazy arrays are read the general way.
        for lazy in walk.lazy:
            lazy._shape = None
    return value


def plain(value: Any) -> Any:
    """A value from `loads` with its lazy arrays as the lists `orjson.loads` gives: for what
    holds the lazy key but is not a tensor (an OIP request's parameters)."""
    if isinstance(value, JsonArray):
        return value.to_list()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


class _RepeatedKey(Exception):
    """An object repeats a key: a lookup would give its first value, orjson gives the last."""


class _Walk:
    """simdjson's values as Python's, counting the arrays it meets: every `[` of a text whose
    lazy arrays are rectangular arrays of numbers. (A loop per container with the scalars
    taken inline: a call per value cost a fifth more.)"""

    def __init__(self, lazy_key: str) -> None:
        self.lazy_key = lazy_key
        self.arrays = 0
        self.lazy: list[JsonArray] = []

    def python(self, value: Any) -> Any:
        kind = type(value)
        if kind is _OBJECT:
            return self._object(value)
        if kind is _ARRAY:
            return self._array(value, None)
        return value

    def _object(self, value: simdjson.Object) -> dict[str, Any]:
        # Looked up key by key: items() would convert the values, lazy arrays included.
        keys = list(value)
        if len(set(keys)) != len(keys):
            raise _RepeatedKey
        out: dict[str, Any] = {}
        for key in keys:
            item: Any = value[key]  # narrowed by `type(...) is`, which mypy does not follow
            kind = type(item)
            if kind is _OBJECT:
                item = self._object(item)
            elif kind is _ARRAY:
                item = self._array(item, key)
            out[key] = item
        return out

    def _array(self, value: simdjson.Array, key: str | None) -> Any:
        if key == self.lazy_key:
            shape = _shape(value)
            self.arrays += 1 if shape is None else _arrays_in(shape)
            lazy = JsonArray(value, shape)
            self.lazy.append(lazy)
            return lazy
        self.arrays += 1
        out: list[Any] = []
        element: Any
        for element in value:
            kind = type(element)
            if kind is _OBJECT:
                out.append(self._object(element))
            elif kind is _ARRAY:
                out.append(self._array(element, None))
            else:
                out.append(element)
        return out


def _read(array: simdjson.Array, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray | None:
    of_type = _BUFFER_TYPES.get(dtype.kind)
    if of_type is None:
        return None
    try:
        # Every leaf in order, whatever the nesting: the caller made sure that the nesting is
        # the rectangular one `shape` describes, with no array inside the innermost ones.
        flat = np.frombuffer(array.as_buffer(of_type=of_type), dtype=_BUFFER_DTYPES[of_type])
    except _FAILURES:
        return None  # a leaf that is not a number of that kind
    if flat.size != math.prod(shape):
        return None
    if of_type != "d" and flat.size:
        limits = np.iinfo(dtype)
        if flat.min() < limits.min or flat.max() > limits.max:
            return None
    return flat.astype(dtype, copy=False).reshape(shape)


def _shape(array: simdjson.Array) -> tuple[int, ...] | None:
    """The shape of a rectangular nesting of arrays, from its first elements down, when every
    array above the innermost level has the lengths it says; None otherwise. That the innermost
    arrays hold numbers only is for the buffer and the count of `[` to show."""
    dims: list[int] = []
    node: Any = array
    while isinstance(node, simdjson.Array):
        if len(dims) == _MAX_RANK:
            return None
        dims.append(len(node))
        if not dims[-1]:
            break
        node = node[0]
    return tuple(dims) if _rectangular(array, dims, 0) else None


def _rectangular(array: simdjson.Array, dims: list[int], level: int) -> bool:
    if level == len(dims) - 1:
        return True
    for child in array:
        if not isinstance(child, simdjson.Array) or len(child) != dims[level + 1]:
            return False
        if not _rectangular(child, dims, level + 1):
            return False
    return True


def _arrays_in(shape: tuple[int, ...]) -> int:
    """How many arrays a rectangular nesting of `shape` is written with (its `[`s)."""
    return sum(math.prod(shape[:level]) for level in range(len(shape)))
