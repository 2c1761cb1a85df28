"""gRPC wire messages <-> protocol-neutral requests and responses.

OIP: typed `contents` or `raw_input_contents` in; outputs always go back as
`raw_output_contents` (as Triton does; every OIP client reads them). TorchServe: the `input` map
is the request's fields by name, the answer the same bytes `/predictions` answers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from scriptserve.archiver.signature import TensorSpec, datatype_of
from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.description import ModelMetadata
from scriptserve.server.errors import InvalidInput
from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip
from scriptserve.server.rawtensors import decode_raw, encode_raw, tensor_dtype

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


def parameter_value(param: oip.InferParameter) -> Any:
    choice = param.WhichOneof("parameter_choice")
    return getattr(param, choice) if choice else None


def _typed_input(tensor: Any) -> np.ndarray:
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    dtype = tensor_dtype(name, datatype)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"input {name!r}: {datatype} must be sent in raw_input_contents")
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(f"input {name!r}: shape {shape} needs {count} values, got {len(values)}")
    if datatype == "BYTES":
        return np.array(list(values), dtype=np.object_).reshape(shape)
    try:
        return np.array(values, dtype=dtype).reshape(shape)
    except OverflowError:
        raise InvalidInput(f"input {name!r}: a value does not fit {datatype}") from None


def infer_request(msg: oip.ModelInferRequest) -> tuple[InferenceRequest, list[str]]:
    """An OIP ModelInferRequest as an InferenceRequest, plus the requested output names."""
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
        if any(d < 0 for d in tensor.shape):
            raise InvalidInput(f"input {tensor.name!r}: shape dimensions must be >= 0")
        if tensor.name in inputs:
            raise InvalidInput(f"input {tensor.name!r} appears twice")
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInput("use either raw_input_contents or contents, not both")
            array = decode_raw(tensor.name, tensor.datatype, list(tensor.shape), raw[i])
        else:
            array = _typed_input(tensor)
        inputs[tensor.name] = array
    request = InferenceRequest(
        inputs=inputs,
        parameters={k: parameter_value(v) for k, v in msg.parameters.items()},
    )
    if msg.id:
        request.request_id = msg.id
    return request, [o.name for o in msg.outputs]


def infer_response(
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: dict[str, np.ndarray],
    requested: list[str],
    into: oip.ModelInferResponse | None = None,
) -> oip.ModelInferResponse:
    """The answer as a ModelInferResponse, written `into` an existing (empty) message if given:
    a stream's reply embeds one, and filling it in place spares copying the tensors."""
    unknown = [n for n in requested if n not in outputs]
    if unknown:
        known = ", ".join(outputs)
        raise InvalidInput(f"unknown output(s) {', '.join(unknown)}; the model's are {known}")
    response = oip.ModelInferResponse() if into is None else into
    response.model_name = model_name
    response.model_version = model_version
    response.id = request_id
    for name in requested or list(outputs):
        array = outputs[name]
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        response.raw_output_contents.append(encode_raw(array))
    return response


def _tensor_metadata(specs: tuple[TensorSpec, ...]) -> list[Any]:
    return [
        oip.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)
        for t in specs
    ]


def metadata_response(meta: ModelMetadata) -> oip.ModelMetadataResponse:
    return oip.ModelMetadataResponse(
        name=meta.name,
        versions=meta.versions,
        platform=meta.platform,
        inputs=_tensor_metadata(meta.inputs),
        outputs=_tensor_metadata(meta.outputs),
    )


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


def metadata_value(metadata: Any, key: str) -> str | None:
    """The value of `key` in a call's metadata, if sent."""
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else value.decode()
    return None


def requested_quantize(metadata: Any) -> str | None:
    """The `scriptserve-quantize` value of a call's metadata, if sent."""
    return metadata_value(metadata, QUANTIZE_METADATA)


def requested_worker_mode(metadata: Any) -> str | None:
    """The `scriptserve-worker-mode` value of a call's metadata, if sent."""
    return metadata_value(metadata, WORKER_MODE_METADATA)


def predictions_request(model_input: dict[str, bytes]) -> InferenceRequest:
    """TorchServe's `input` map: fields by name; `data` (or `body`, or the only one) is the body."""
    if not model_input:
        raise InvalidInput("the request's input map is empty; send the model's input as 'data'")
    fields = dict(model_input)
    body = fields.get("data", fields.get("body", next(iter(fields.values()))))
    return InferenceRequest(body=body, fields=fields)
