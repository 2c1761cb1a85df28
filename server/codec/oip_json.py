"""Open Inference Protocol v2 over HTTP: JSON tensors and the binary tensor extension.

A request body is a JSON header, optionally followed by raw tensor bytes when the
`Inference-Header-Content-Length` header gives the JSON's length. Raw tensors are little-endian,
row-major; a BYTES element is a 4-byte little-endian length and the bytes.

A client sends the same envelope again and again with other numbers in it. A JSON request
whose text differs from one decoded before only inside its one flat `data` array (the same
bytes before it, the same after) is read as that array alone (`_Envelope`), in less time than
the whole document, the same result to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from scriptserve.handlers.base import InferenceRequest
from scriptserve.handlers.runtime import json_numbers
from scriptserve.handlers.runtime.json_numbers import array_from_text
from scriptserve.handlers.runtime.signature import datatype_of
from scriptserve.server.codec.header_values import non_negative_int
from scriptserve.server.codec.tensors import (
    add_input,
    check_shape,
    decode_raw,
    encode_raw,
    from_values,
)
from scriptserve.server.errors import InvalidInput

HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass
class OipRequest:
    inference: InferenceRequest
    id: str | None
    requested: dict[str, bool] = field(default_factory=dict)
    """Requested output name -> send it binary; empty = every output, as `binary_default`."""
    binary_default: bool = False


def _tensor(spec: Any, binary: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    if not isinstance(spec, dict):
        raise InvalidInput("each entry of 'inputs' must be an object with name, shape, datatype")
    name = spec.get("name")
    datatype = spec.get("datatype")
    if not isinstance(name, str) or not name:
        raise InvalidInput("an input has no 'name'")
    shape = check_shape(name, spec.get("shape"))
    if not isinstance(datatype, str):
        raise InvalidInput(f"input {name!r}: 'datatype' is missing")
    params = spec.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise InvalidInput(f"input {name!r}: binary_data_size exceeds the binary data sent")
        raw = bytes(binary[offset : offset + size])
        return name, decode_raw(name, datatype, shape, raw), offset + size
    if "data" not in spec:
        raise InvalidInput(f"input {name!r} has neither 'data' nor binary_data_size")
    return name, from_values(name, datatype, shape, spec["data"]), offset


@dataclass(frozen=True)
class _Envelope:
    """A JSON request as decoded, but for the numbers of its one input: what follows them in
    its text, and what the rest of the text decodes to (kept by the text before them)."""

    suffix: bytes
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    parameters: dict[str, Any]
    """The request's parameters: scalars only, so that a copy of the dict is a copy of them."""
    requested: dict[str, bool]
    binary_default: bool


_ENVELOPES: dict[bytes, _Envelope] = {}
"""By the text before the numbers. Read and written by every worker thread that decodes: each
lookup, store and clearing is one dict operation, atomic under the GIL."""
_ENVELOPES_KEPT = 64
"""Envelopes remembered across requests; one more and they are all forgotten."""
_ENVELOPE_MAX_BYTES = 1024
"""The most text around the numbers an envelope keeps (a long one is decoded whole each time)."""
_SCALARS = (str, int, float, bool, type(None))


def _data_span(body: bytes) -> tuple[int, int] | None:
    """Where the array after the first `"data"` runs, from its `[` to its first `]`."""
    key = body.find(b'"data"')
    start = body.find(b"[", key) if key >= 0 else -1
    end = body.find(b"]", start) + 1 if start >= 0 else 0
    return (start, end) if end else None


def _envelope_of(body: bytes) -> tuple[_Envelope, bytes] | None:
    """The remembered envelope the text is, and the text of its numbers; None when it is none."""
    span = _data_span(body)
    if span is None:
        return None
    start, end = span
    envelope = _ENVELOPES.get(body[:start])
    if envelope is None or body[end:] != envelope.suffix:
        return None
    return envelope, body[start:end]


def _enveloped(
    envelope: _Envelope, values: np.ndarray, headers: Mapping[str, str] | None
) -> OipRequest | None:
    """The request an envelope makes with these numbers; None when they do not fit it."""
    if values.size != math.prod(envelope.shape):
        return None
    inference = InferenceRequest(
        inputs={envelope.name: values.reshape(envelope.shape)},
        parameters=dict(envelope.parameters),
        headers=headers or {},
        outputs=list(envelope.requested),
    )
    return OipRequest(inference, None, dict(envelope.requested), envelope.binary_default)


def _from_envelope(body: bytes, headers: Mapping[str, str] | None) -> OipRequest | None:
    """The request, when its text is a remembered envelope around a flat array of numbers that
    fits it; None otherwise (the whole text is then decoded)."""
    found = _envelope_of(body)
    if found is None:
        return None
    envelope, numbers = found
    # The same text around a single JSON array (array_from_text reads nothing else): the same
    # document as the remembered one, with other numbers for its only `data` key.
    values = array_from_text(numbers, envelope.dtype)
    return None if values is None else _enveloped(envelope, values, headers)


def _remember(body: bytes, decoded: OipRequest) -> None:
    """Keep the envelope of a JSON request that `_from_envelope` can read again: its text has
    one `"data"`, the key of its one input's numbers (`"data"` followed by a colon is a key
    wherever it appears in valid JSON: a string cannot hold an unescaped quote), those numbers
    are a flat array (its first `]` ends it), and it has no id and only scalar parameters."""
    inputs = decoded.inference.inputs
    parameters = decoded.inference.parameters
    if decoded.id is not None or len(inputs) != 1 or body.count(b'"data"') != 1:
        return
    span = _data_span(body)
    if span is None:
        return
    start, end = span
    if (
        start + len(body) - end > _ENVELOPE_MAX_BYTES
        or body.find(b"[", start + 1, end) >= 0  # an array inside them: not flat
        or body[body.find(b'"data"') + 6 : start].strip() != b":"
        or not all(type(v) in _SCALARS for v in parameters.values())
    ):
        return
    ((name, array),) = inputs.items()
    if array.dtype.kind not in "fiu":
        return
    if len(_ENVELOPES) >= _ENVELOPES_KEPT:
        _ENVELOPES.clear()
    _ENVELOPES[body[:start]] = _Envelope(
        suffix=body[end:],
        name=name,
        dtype=array.dtype,
        shape=array.shape,
        parameters=dict(parameters),
        requested=dict(decoded.requested),
        binary_default=decoded.binary_default,
    )


@dataclass(frozen=True)
class _Header:
    """A binary request's JSON header as decoded: one input, whose raw bytes are all that
    follows the header."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    size: int
    parameters: dict[str, Any]
    """Scalars only, so that a copy of the dict is a copy of them."""
    requested: dict[str, bool]
    binary_default: bool


_HEADERS: dict[bytes, _Header] = {}
"""By the header's text; as bounded, and as safe to share between threads, as `_ENVELOPES`."""


def _from_header(body: bytes, split: int, headers: Mapping[str, str] | None) -> OipRequest | None:
    """The request, when its JSON header is a remembered one and the bytes after it are as many
    as it says; None otherwise (the request is then decoded whole)."""
    header = _HEADERS.get(body[:split])
    if header is None or len(body) - split != header.size:
        return None
    array = decode_raw(header.name, header.datatype, [*header.shape], body[split:])
    inference = InferenceRequest(
        inputs={header.name: array},
        parameters=dict(header.parameters),
        headers=headers or {},
        outputs=list(header.requested),
    )
    return OipRequest(inference, None, dict(header.requested), header.binary_default)


def _remember_header(header: bytes, doc: dict[str, Any], decoded: OipRequest) -> None:
    """Keep a binary request's header that decodes the same for any bytes of the size it gives:
    one input, sent as raw bytes (not BYTES), no id, scalar parameters, at most 1 kB."""
    inputs = decoded.inference.inputs
    if decoded.id is not None or len(inputs) != 1 or len(doc["inputs"]) != 1:
        return
    (spec,) = doc["inputs"]
    tensor_params = spec.get("parameters")
    if not isinstance(tensor_params, dict) or "binary_data_size" not in tensor_params:
        return
    parameters = decoded.inference.parameters
    if spec["datatype"] == "BYTES" or not all(type(v) in _SCALARS for v in parameters.values()):
        return
    if len(header) > _ENVELOPE_MAX_BYTES:
        return
    ((name, array),) = inputs.items()
    if len(_HEADERS) >= _ENVELOPES_KEPT:
        _HEADERS.clear()
    _HEADERS[header] = _Header(
        name=name,
        datatype=spec["datatype"],
        shape=array.shape,
        size=array.nbytes,
        parameters=dict(parameters),
        requested=dict(decoded.requested),
        binary_default=decoded.binary_default,
    )


def decode_request(
    body: bytes, header_length: str | None, headers: Mapping[str, str] | None = None
) -> OipRequest:
    """Parse an infer request body; raises InvalidInput naming what is wrong."""
    if header_length is None:
        known = _from_envelope(body, headers)
        if known is not None:
            return known
    if header_length is not None:
        length = non_negative_int(header_length)
        if length is None or length > len(body):
            raise InvalidInput(f"{HEADER_LENGTH} must be the JSON header's length in bytes")
        split = length
        known = _from_header(body, split, headers)
        if known is not None:
            return known
    else:
        split = len(body)
    try:
        # The inputs' `data` arrays are read into numpy by from_values, without Python floats.
        doc = json_numbers.loads(body[:split], lazy_key="data")
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise InvalidInput("the request must be a JSON object with a non-empty 'inputs' list")
    binary = memoryview(body)[split:]
    offset = 0
    inputs: dict[str, np.ndarray] = {}
    for spec in doc["inputs"]:
        name, array, offset = _tensor(spec, binary, offset)
        add_input(inputs, name, array)
    if offset != len(binary):
        raise InvalidInput("the binary data is longer than the inputs' binary_data_size")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    params = json_numbers.plain(params)  # a `data` array in them is the client's, as sent
    requested: dict[str, bool] = {}
    binary_default = bool(params.get("binary_data_output", False))
    for out in doc.get("outputs") or []:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise InvalidInput("each entry of 'outputs' must be an object with a 'name'")
        out_params = out.get("parameters") or {}
        if not isinstance(out_params, dict):
            raise InvalidInput(f"output {out['name']!r}: 'parameters' must be an object")
        requested[out["name"]] = bool(out_params.get("binary_data", binary_default))
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    inference = InferenceRequest(
        inputs=inputs, parameters=params, headers=headers or {}, outputs=list(requested)
    )
    if request_id:
        inference.request_id = request_id
    decoded = OipRequest(inference, request_id, requested, binary_default)
    if header_length is None:
        _remember(body, decoded)
    else:
        _remember_header(body[:split], doc, decoded)
    return decoded


def encode_response(
    model_name: str,
    model_version: str,
    request: OipRequest,
    outputs: list[tuple[str, np.ndarray]],
) -> tuple[bytes, int | None]:
    """The response body for the selected outputs, and the JSON header's length when binary
    tensors follow it."""
    entries = []
    blobs: list[bytes] = []
    for name, array in outputs:
        datatype = datatype_of(array.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if request.requested.get(name, request.binary_default):
            blob = encode_raw(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            entry["data"] = [
                b.decode(errors="replace") if isinstance(b, bytes) else str(b)
                for b in array.ravel()
            ]
        else:
            entry["data"] = array.ravel().tolist()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        doc["id"] = request.id
    doc["outputs"] = entries
    header = orjson.dumps(doc)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


class OipBody:
    """An infer request's body, decoded when the data plane asks (once the model is known), and
    the encoder of its answer, which needs what the request asked for.

        wire = OipBody(body, headers.get(HEADER_LENGTH), headers)
        served = await dataplane.submit(name, None, wire.decode, protocol="rest", encode=wire.keep)
        payload, length = wire.answer  # written by the worker that answered it
    """

    def __init__(self, body: bytes, header_length: str | None, headers: Mapping[str, str]) -> None:
        self._body = body
        self._header_length = header_length
        self._headers = headers
        self._decoded: OipRequest | None = None
        self.answer: tuple[bytes, int | None] | None = None
        """What `keep` wrote: the answer's body, and its JSON header's length when binary."""
        self._read: tuple[_Envelope, np.ndarray] | None = None
        """Its envelope and numbers, when `read_together` read them with a batch's others."""

    @staticmethod
    def read_together(bodies: Sequence[OipBody]) -> None:
        """Read the numbers of a batch's JSON bodies in one parse, when each is one remembered
        envelope around its numbers, the same for all (`json_numbers.rows_from_texts`): each
        body then decodes without parsing them again. Otherwise nothing is read, and each body
        decodes as it would alone, with its own errors."""
        envelope: _Envelope | None = None
        texts: list[bytes] = []
        for body in bodies:
            found = None if body._header_length is not None else _envelope_of(body._body)
            if found is None or (envelope is not None and found[0] is not envelope):
                return
            envelope = found[0]
            texts.append(found[1])
        if envelope is None:
            return
        rows = json_numbers.rows_from_texts(texts, envelope.dtype)
        if rows is None:
            return
        for body, row in zip(bodies, rows, strict=True):
            body._read = (envelope, row)

    def decode(self) -> InferenceRequest:
        read, self._read = self._read, None
        known = None if read is None else _enveloped(*read, self._headers)
        self._decoded = known or decode_request(self._body, self._header_length, self._headers)
        return self._decoded.inference

    def encode(
        self, model_name: str, model_version: str, outputs: list[tuple[str, np.ndarray]]
    ) -> tuple[bytes, int | None]:
        if self._decoded is None:
            raise RuntimeError("encode() before decode()")
        return encode_response(model_name, model_version, self._decoded, outputs)

    def keep(
        self, model_name: str, model_version: str, outputs: list[tuple[str, np.ndarray]]
    ) -> None:
        """Encode the answer and keep it in `answer` (on the thread that made the answer)."""
        self.answer = self.encode(model_name, model_version, outputs)
