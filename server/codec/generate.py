"""Triton's generate extension: `POST /v2/models/{m}/generate` and `/generate_stream`.

A request is one JSON object: `parameters` (an object) are the request's parameters, every other
key is an input tensor of one row: a string becomes a BYTES element, a number, boolean or
(nested) list an array of JSON's type (int64, float64, bool), each with a batch dimension of 1
in front. A response, or each event of a stream, is `{"model_name", "model_version", output:
value, ...}` with each output's row as a plain JSON value (one element as a scalar, BYTES as
text); a handler's answer that has no tensors is `text_output` (text, or its JSON). Errors are
`{"error": message}`.

    $ curl -d '{"text_input": "ab", "parameters": {"max_tokens": 8}}' \\
        localhost:8080/v2/models/tinylm/generate_stream
    data: {"model_name":"tinylm","model_version":"1.0","text_output":"c"}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.server.codec.torchserve import json_default
from scriptserve.server.errors import InvalidInput, ServingError

TEXT_OUTPUT = "text_output"
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _tensor(name: str, value: Any) -> np.ndarray:
    if isinstance(value, str):
        return np.array([value.encode()], dtype=object)
    if isinstance(value, dict) or value is None:
        raise InvalidInput(
            f"input {name!r} must be a string, a number, a boolean or a list of them"
        )
    try:
        array = np.asarray(value)
    except ValueError:
        array = np.asarray([], dtype=object)  # ragged: refused below
    if array.dtype.kind not in "biuf":
        raise InvalidInput(
            f"input {name!r} must be a string, or numbers or booleans in a list of even depth "
            "(a tensor)"
        )
    return array[None]


def generate_request(body: bytes, headers: Mapping[str, str]) -> InferenceRequest:
    """The InferenceRequest of a generate call's body; InvalidInput names what is wrong."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise InvalidInput('the request must be a JSON object, e.g. {"text_input": "..."}')
    parameters = doc.pop("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object")
    if not doc:
        raise InvalidInput('the request names no input; send e.g. {"text_input": "..."}')
    inputs = {str(name): _tensor(str(name), value) for name, value in doc.items()}
    return InferenceRequest(inputs=inputs, parameters=parameters, headers=headers)


def _value(array: np.ndarray) -> Any:
    row = array[0] if array.ndim > 0 and array.shape[0] == 1 else array
    if isinstance(row, np.ndarray) and row.size == 1:
        row = row.reshape(())[()]
    if isinstance(row, np.ndarray):
        if row.dtype == object:
            return [b.decode(errors="replace") if isinstance(b, bytes) else b for b in row.ravel()]
        return row
    return row.decode(errors="replace") if isinstance(row, bytes) else row


def generate_response(model_name: str, model_version: str, response: InferenceResponse) -> bytes:
    """The JSON of one answer (or streamed part)."""
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if response.outputs:
        for name, array in response.outputs.items():
            doc[name] = _value(array)
    elif isinstance(response.body, (bytes, bytearray)):
        doc[TEXT_OUTPUT] = bytes(response.body).decode(errors="replace")
    elif isinstance(response.body, str):
        doc[TEXT_OUTPUT] = response.body
    elif response.body is not None:
        doc[TEXT_OUTPUT] = orjson.dumps(response.body, default=json_default).decode()
    return orjson.dumps(doc, default=json_default, option=_NUMPY)


def error_json(error: ServingError) -> bytes:
    return orjson.dumps({"error": error.message})


def event(data: bytes) -> bytes:
    """One Server-Sent Event carrying `data` (JSON: one line)."""
    return b"data: " + data + b"\n\n"
