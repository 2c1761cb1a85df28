"""Open Inference Protocol v2 over HTTP: JSON tensors and the binary tensor extension.

A request body is a JSON header, optionally followed by raw tensor bytes when the
`Inference-Header-Content-Length` header gives the JSON's length. Raw tensors are little-endian,
row-major; a BYTES element is a 4-byte little-endian length and the bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from scriptserve.archiver.signature import datatype_of
from scriptserve.server.errors import InvalidInput
from scriptserve.server.rawtensors import decode_raw, encode_raw, tensor_dtype

HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass
class OipRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    requested: dict[str, bool] = field(default_factory=dict)
    """Requested output name -> send it binary; empty = every output, as `binary_default`."""
    binary_default: bool = False


def _tensor(spec: Any, binary: memoryview, offset: int) -> tuple[str, np.ndarray, int]:
    if not isinstance(spec, dict):
        raise InvalidInput("each entry of 'inputs' must be an object with name, shape, datatype")
    name = spec.get("name")
    shape = spec.get("shape")
    datatype = spec.get("datatype")
    if not isinstance(name, str) or not name:
        raise InvalidInput("an input has no 'name'")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of non-negative integers")
    if not isinstance(datatype, str):
        raise InvalidInput(f"input {name!r}: 'datatype' is missing")
    dtype = tensor_dtype(name, datatype)
    count = math.prod(shape)
    params = spec.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise InvalidInput(f"input {name!r}: binary_data_size exceeds the binary data sent")
        raw = bytes(binary[offset : offset + size])
        return name, decode_raw(name, datatype, shape, raw), offset + size
    if "data" not in spec:
        raise InvalidInput(f"input {name!r} has neither 'data' nor binary_data_size")
    data = spec["data"]
    try:
        if datatype == "BYTES":
            flat = np.array(
                [d.encode() if isinstance(d, str) else bytes(d) for d in np.ravel(data)],
                dtype=np.object_,
            )
        else:
            flat = np.asarray(data, dtype=dtype).ravel()
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: data is not a valid {datatype} array: {exc}") from None
    if flat.size != count:
        raise InvalidInput(f"input {name!r}: shape {shape} needs {count} values, got {flat.size}")
    return name, flat.reshape(shape), offset


def decode_request(body: bytes, header_length: str | None) -> OipRequest:
    """Parse an infer request body; raises InvalidInput naming what is wrong."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidInput(f"{HEADER_LENGTH} must be the JSON header's length in bytes")
        split = int(header_length)
    else:
        split = len(body)
    try:
        doc = orjson.loads(body[:split])
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise InvalidInput("the request must be a JSON object with a non-empty 'inputs' list")
    binary = memoryview(body)[split:]
    offset = 0
    inputs: dict[str, np.ndarray] = {}
    for spec in doc["inputs"]:
        name, array, offset = _tensor(spec, binary, offset)
        if name in inputs:
            raise InvalidInput(f"input {name!r} appears twice")
        inputs[name] = array
    if offset != len(binary):
        raise InvalidInput("the binary data is longer than the inputs' binary_data_size")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
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
    return OipRequest(
        request_id,
        inputs,
        params,
        requested,
        binary_default,
    )


def encode_response(
    model_name: str,
    model_version: str,
    request: OipRequest,
    outputs: dict[str, np.ndarray],
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary tensors follow it."""
    unknown = [n for n in request.requested if n not in outputs]
    if unknown:
        known = ", ".join(outputs)
        raise InvalidInput(f"unknown output(s) {', '.join(unknown)}; the model's are {known}")
    names = list(request.requested) or list(outputs)
    entries = []
    blobs: list[bytes] = []
    for name in names:
        array = outputs[name]
        datatype = datatype_of(array.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if request.requested.get(name, request.binary_default):
            blob = encode_raw(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            entry["data"] = [b.decode(errors="replace") if isinstance(b, bytes) else str(b)
                             for b in array.ravel()]  # fmt: skip
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
