"""gRPC wire messages <-> protocol-neutral requests and responses.

OIP: typed `contents` or `raw_input_contents` in, checked by the same tensor codec as REST;
outputs always go back as `raw_output_contents` (as Triton does; every OIP client reads them).
TorchServe: the `input` map is the request's fields by name (`server/codec/torchserve.py`),
management messages become the parameters the REST management API takes.

Converters read and fill messages by field name and never import the generated OIP module: a
Triton client's own messages (the same wire types, package `inference`) work with them too,
which is how the tests drive them in a process that has tritonclient loaded.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.codec.tensors import (
    add_input,
    check_shape,
    decode_raw,
    from_values,
    raw_output,
    tensor_dtype,
)
from scriptserve.server.errors import InvalidInput, ServingError
from scriptserve.server.inference.decoding import Served
from scriptserve.server.models.description import ModelMetadata

M = TypeVar("M")
"""A message to fill: ours, or a Triton client's of the same wire type."""

# Which InferTensorContents field carries each datatype (FP16/BF16 travel raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def parameter_value(param: Any) -> Any:
    choice = param.WhichOneof("parameter_choice")
    return getattr(param, choice) if choice else None


def _typed_input(tensor: Any, shape: list[int]) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    tensor_dtype(name, datatype)  # an unknown datatype is named before its contents field
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"input {name!r}: {datatype} must be sent in raw_input_contents")
    return from_values(name, datatype, shape, getattr(tensor.contents, field))


def version_of(value: str) -> str | None:
    """The version a request names; empty means the model's default version."""
    return value or None


def infer_request(msg: Any) -> InferenceRequest:
    """An OIP ModelInferRequest as an InferenceRequest (its requested outputs included)."""
    if not msg.inputs:
        raise InvalidInput("the request has no inputs")
    raw = list(msg.raw_input_contents)
    if raw and len(raw) != len(msg.inputs):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries for {len(msg.inputs)} inputs; "
            "send one per input, in order"
        )
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(msg.inputs):
        shape = check_shape(tensor.name, tensor.shape)
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInput("use either raw_input_contents or contents, not both")
            array = decode_raw(tensor.name, tensor.datatype, shape, raw[i])
        else:
            array = _typed_input(tensor, shape)
        add_input(inputs, tensor.name, array)
    request = InferenceRequest(
        inputs=inputs,
        parameters={k: parameter_value(v) for k, v in msg.parameters.items()},
        outputs=[o.name for o in msg.outputs],
    )
    if msg.id:
        request.request_id = msg.id
    return request


def fill_infer_response(served: Served, request_id: str, response: M) -> M:
    """Write the answer into an empty ModelInferResponse (a stream's reply embeds one, and
    filling it in place spares copying the tensors); returns it."""
    write_infer_response(
        response, request_id, served.model_name, served.model_version, served.outputs
    )
    return response


def write_infer_response(
    response: object,
    request_id: str,
    model_name: str,
    model_version: str,
    outputs: list[tuple[str, np.ndarray]],
) -> None:
    """Write an answer into an empty ModelInferResponse: `ModelInfer` has the worker that
    answered write it (the data plane's `encode`), as the worker read the request."""
    message: Any = response
    message.model_name = model_name
    message.model_version = model_version
    message.id = request_id
    for name, array in outputs:
        datatype, raw = raw_output(array)
        message.outputs.add(name=name, datatype=datatype, shape=array.shape)
        message.raw_output_contents.append(raw)


def fill_stream_reply(request: Any, outcome: asyncio.Future[Served], reply: M) -> M:
    """Write a stream's reply to one request into an empty ModelStreamInferResponse: its
    answer, or its error in `error_message` with the request's model name and id."""
    message: Any = reply
    error = outcome.exception()
    if error is None:
        fill_infer_response(outcome.result(), request.id, message.infer_response)
        return reply
    failed = error.message if isinstance(error, ServingError) else "the request failed"
    message.error_message = failed
    message.infer_response.model_name = request.model_name
    message.infer_response.id = request.id
    return reply


def fill_metadata(meta: ModelMetadata, response: M) -> M:
    """Write a model's metadata into an empty ModelMetadataResponse; returns it."""
    message: Any = response
    message.name = meta.name
    message.versions.extend(meta.versions)
    message.platform = meta.platform
    for specs, tensors in ((meta.inputs, message.inputs), (meta.outputs, message.outputs)):
        for spec in specs:
            tensors.add(name=spec.name, datatype=spec.datatype, shape=spec.shape)
    return response


def from_json(values: dict[str, Any], message: M) -> M:
    """Fill an empty message from the JSON form the REST routes answer with (Triton's model
    configuration, statistics, repository index): one source for both transports."""
    json_format.ParseDict(values, message)
    return message


def repository_parameters(parameters: Any) -> dict[str, Any]:
    """A repository request's `ModelRepositoryParameter` map as plain values."""
    return {key: parameter_value(value) for key, value in parameters.items()}


QUANTIZE_METADATA = "scriptserve-quantize"
"""RegisterModel request metadata: `dynamic-int8` converts the model at load (TorchServe's
RegisterModelRequest has no field for it)."""
QUANTIZATION_METADATA = "scriptserve-quantization"
"""ModelMetadata trailing metadata: `none` or `dynamic-int8`, plus `-<parameter>` entries."""


def quantization_metadata(meta: ModelMetadata) -> tuple[tuple[str, str], ...]:
    """`scriptserve-quantization: dynamic-int8` and one `scriptserve-quantization-*` per detail."""
    items = [(QUANTIZATION_METADATA, str(meta.parameters.get("quantization", "none")))]
    for key, value in meta.parameters.items():
        if key.startswith("quantization_"):
            name = key.removeprefix("quantization_").replace("_", "-")
            items.append((f"{QUANTIZATION_METADATA}-{name}", str(value)))
    return tuple(items)


WORKER_MODE_METADATA = "scriptserve-worker-mode"
"""RegisterModel request metadata: `thread` or `process` workers for the model."""


def registration_metadata(metadata: Any) -> dict[str, str]:
    """The registration settings a RegisterModel call sends as metadata (its message has no
    fields for them), under the registration's own names."""
    names = {QUANTIZE_METADATA: "quantize", WORKER_MODE_METADATA: "worker_mode"}
    found = {}
    for key, value in metadata or ():
        if key in names:
            found[names[key]] = value if isinstance(value, str) else value.decode()
    return found


def given_fields(msg: Message) -> dict[str, Any]:
    """A TorchServe message's fields as parameters: a zero number or an empty string means "not
    given", as in TorchServe (proto3 cannot tell them apart); booleans are always given."""
    given: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if isinstance(value, bool) or value not in (0, ""):
            given[field.name] = value
    return given
