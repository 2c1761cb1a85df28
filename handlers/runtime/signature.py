"""Input/output signature of a model: tensor names, Open Inference Protocol datatypes, shapes.

A dimension of -1 is dynamic (the batch dimension, or any other a model accepts at any size).

>>> spec = TensorSpec("input0", "FP32", (-1, 512))
>>> spec.accepts_shape((3, 512))
True
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scriptserve.handlers.runtime import json_numbers

# OIP datatype name <-> numpy dtype. BYTES tensors are numpy object arrays of bytes.
_NUMPY_BY_DATATYPE: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_DATATYPE_BY_NUMPY: dict[np.dtype[Any], str] = {v: k for k, v in _NUMPY_BY_DATATYPE.items()}

DATATYPES: tuple[str, ...] = (*_NUMPY_BY_DATATYPE, "BF16")


class SignatureError(ValueError):
    """A signature, datatype or shape that cannot be used; the message says what to fix."""


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The numpy dtype for an OIP datatype name (BF16 has none in numpy)."""
    try:
        return _NUMPY_BY_DATATYPE[datatype]
    except KeyError:
        known = ", ".join(_NUMPY_BY_DATATYPE)
        raise SignatureError(f"unsupported datatype {datatype!r}; use one of {known}") from None


BYTES_KINDS = ("S", "U", "O")
"""The numpy dtype kinds that are OIP's BYTES: bytes, str and object arrays."""


def datatype_of(dtype: np.dtype[Any] | type) -> str:
    """The OIP datatype name of a numpy dtype."""
    dt = np.dtype(dtype)
    if dt.kind in BYTES_KINDS:
        return "BYTES"
    try:
        return _DATATYPE_BY_NUMPY[dt]
    except KeyError:
        raise SignatureError(f"numpy dtype {dt} has no Open Inference Protocol datatype") from None


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a signature."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            raise SignatureError(f"tensor {self.name!r}: unknown datatype {self.datatype!r}")
        if any(d < -1 for d in self.shape):
            raise SignatureError(f"tensor {self.name!r}: dimensions must be >= -1")

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        """True when `shape` has this rank and matches every fixed dimension."""
        if len(shape) != len(self.shape):
            return False
        return all(want in (-1, got) for want, got in zip(self.shape, shape, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        try:
            return cls(
                str(data["name"]), str(data["datatype"]), tuple(int(d) for d in data["shape"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SignatureError(f"tensor spec needs name, datatype and shape: {exc}") from None


_ACCEPTED_KEPT = 256
"""Accepted (name, dtype, shape) keys a signature remembers: a client choosing a new batch size
per request cannot grow it further; the keys after these are checked in full each time."""


@dataclass(frozen=True)
class Signature:
    """Inputs and outputs of a model, in the order the model takes and returns them."""

    inputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    outputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    _accepted: dict[tuple[str, np.dtype[Any], tuple[int, ...]], None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    """(name, dtype, shape) of inputs `check_inputs` accepted, at most `_ACCEPTED_KEPT`: a
    request is checked by the data plane and again by its handler, and a lookup here costs
    a fraction of a check, which holds the GIL."""

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def check_inputs(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Named arrays against the inputs: names, datatypes, ranks and fixed sizes (-1 is any
        size). Raises SignatureError naming the first difference."""
        accepted = self._accepted
        if len(arrays) == len(self.inputs) and all(
            (name, array.dtype, array.shape) in accepted for name, array in arrays.items()
        ):
            return  # every input accepted before, and as many as the model takes: none missing
        for name, array in arrays.items():
            spec = self.input(name)
            if spec is None:
                known = ", ".join(t.name for t in self.inputs)
                raise SignatureError(f"unknown input {name!r}; the model's inputs are {known}")
            got = datatype_of(array.dtype)
            if got != spec.datatype:
                raise SignatureError(
                    f"input {name!r} has datatype {got}; the model expects {spec.datatype}"
                )
            if not spec.accepts_shape(array.shape):
                raise SignatureError(
                    f"input {name!r} has shape {list(array.shape)}; the model expects "
                    f"{list(spec.shape)} (-1 = any size)"
                )
        missing = [t.name for t in self.inputs if t.name not in arrays]
        if missing:
            raise SignatureError(f"missing input(s): {', '.join(missing)}")
        for name, array in arrays.items():
            if len(accepted) < _ACCEPTED_KEPT:
                accepted[(name, array.dtype, array.shape)] = None

    def with_dynamic_dim(self, dim: int, names: Collection[str]) -> Signature:
        """This signature with dimension `dim` of the inputs `names` any size (-1)."""
        if not names:
            return self
        inputs = tuple(
            TensorSpec(
                t.name, t.datatype, tuple(-1 if i == dim else d for i, d in enumerate(t.shape))
            )
            if t.name in names
            else t
            for t in self.inputs
        )
        return Signature(inputs, self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Signature:
        return cls(
            tuple(TensorSpec.from_dict(t) for t in data.get("inputs", [])),
            tuple(TensorSpec.from_dict(t) for t in data.get("outputs", [])),
        )


def arrays_from_json(
    data: Any, signature: Signature, default_datatype: str | None = "FP32"
) -> dict[str, np.ndarray]:
    """Turn one JSON instance into a batch of one, named by the signature.

    A JSON array is one instance of the model's single input; a JSON object maps input names to
    one instance each. Datatypes come from the signature, else `default_datatype`; None reads
    an input whose numbers are all JSON integers as INT64 (token ids), any other as FP32.

    >>> arrays_from_json([1.0, 2.0], Signature((TensorSpec("x", "FP32", (-1, 2)),)))["x"].shape
    (1, 2)
    """
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list):
        if len(signature.inputs) > 1:
            names = ", ".join(t.name for t in signature.inputs)
            raise SignatureError(
                f"the model takes {len(signature.inputs)} inputs ({names}); "
                "send a JSON object with one array per input name"
            )
        name = signature.inputs[0].name if signature.inputs else "input0"
        items = [(name, data)]
    else:
        raise SignatureError("input must be a JSON array (one instance) or an object of arrays")
    arrays: dict[str, np.ndarray] = {}
    for name, value in items:
        spec = signature.input(name)
        if signature.inputs and spec is None:
            known = ", ".join(t.name for t in signature.inputs)
            raise SignatureError(f"unknown input {name!r}; the model's inputs are {known}")
        datatype = spec.datatype if spec else default_datatype or _json_datatype(value)
        try:
            array = np.asarray(value, dtype=numpy_dtype(datatype))
        except (ValueError, TypeError) as exc:
            raise SignatureError(
                f"input {name!r} is not a rectangular {datatype} array: {exc}"
            ) from None
        arrays[name] = _instance(name, array, spec)
    missing = [t.name for t in signature.inputs if t.name not in arrays]
    if missing:
        raise SignatureError(f"missing input(s): {', '.join(missing)}")
    return arrays


def _json_datatype(value: Any) -> str:
    """INT64 for a JSON array whose numbers are all integers, else FP32."""
    stack = [value]
    seen = False
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            seen = True
        else:
            return "FP32"
    return "INT64" if seen else "FP32"


def arrays_from_text(text: bytes, signature: Signature) -> dict[str, np.ndarray] | None:
    """`arrays_from_json` of a JSON text that is one array of numbers for a model with one input,
    read without a Python number per element (`json_numbers`); None for any other text, which
    the caller parses and hands to `arrays_from_json` (whose messages say what is wrong).

    >>> arrays_from_text(b"[1.0, 2.0]", Signature((TensorSpec("x", "FP32", (-1, 2)),)))["x"].shape
    (1, 2)
    """
    if len(signature.inputs) > 1:
        return None
    spec = signature.inputs[0] if signature.inputs else None
    array = json_numbers.array_from_text(text, numpy_dtype(spec.datatype if spec else "FP32"))
    if array is None:
        return None
    name = spec.name if spec else "input0"
    return {name: _instance(name, array, spec)}


def instances_from_texts(
    texts: Sequence[bytes], signature: Signature
) -> list[dict[str, np.ndarray]] | None:
    """`arrays_from_text` of each text, read in one parse (`json_numbers.rows_from_texts`) when
    every text is one flat array of numbers of one length that the model's one input accepts;
    None otherwise, and each text is then read on its own."""
    if len(signature.inputs) > 1:
        return None
    spec = signature.inputs[0] if signature.inputs else None
    rows = json_numbers.rows_from_texts(texts, numpy_dtype(spec.datatype if spec else "FP32"))
    if rows is None or (spec is not None and not spec.accepts_shape((1, *rows.shape[1:]))):
        return None
    name = spec.name if spec else "input0"
    return [{name: rows[i : i + 1]} for i in range(len(texts))]


def _instance(name: str, array: np.ndarray, spec: TensorSpec | None) -> np.ndarray:
    """One instance of an input as a batch of one, checked against its spec."""
    array = array[np.newaxis, ...]
    if spec is not None and not spec.accepts_shape(array.shape):
        want = [d for d in spec.shape[1:]]
        raise SignatureError(
            f"input {name!r} has shape {list(array.shape[1:])} per instance; "
            f"the model expects {want} (-1 = any size)"
        )
    return array
