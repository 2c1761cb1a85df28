"""TorchServe's wire shapes, over REST and gRPC alike: the request's fields, the prediction's
bytes, and the health answer of `/ping` and `Ping`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.server.errors import InvalidInput

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def predictions_request(
    fields: Mapping[str, bytes],
    content_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> InferenceRequest:
    """A request made of named fields (multipart parts, the gRPC `input` map): `data`, else
    `body`, else the only or first field is the body; every field stays available by name."""
    if not fields:
        raise InvalidInput("the request has no input fields; send the model's input as 'data'")
    fields = dict(fields)
    body = fields.get("data", fields.get("body", next(iter(fields.values()))))
    return InferenceRequest(
        body=body, content_type=content_type, fields=fields, headers=headers or {}
    )


def body_request(
    body: bytes, content_type: str | None, headers: Mapping[str, str] | None = None
) -> InferenceRequest:
    """A request whose whole body is the input (`curl -T`, a JSON body)."""
    if not body:
        raise InvalidInput("the request has no body; send the model's input")
    return InferenceRequest(body=body, content_type=content_type or None, headers=headers or {})


def json_default(value: Any) -> Any:
    """What orjson cannot write itself: non-contiguous arrays, numpy scalars, odd dtypes."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def prediction_payload(response: InferenceResponse) -> tuple[bytes, str]:
    """The bytes and content type of a TorchServe-style prediction."""
    if isinstance(response.body, (bytes, bytearray)):
        return bytes(response.body), response.content_type or "application/octet-stream"
    if response.body is not None:
        content_type = response.content_type or "application/json"
        return orjson.dumps(response.body, default=json_default, option=_NUMPY), content_type
    # orjson writes numpy arrays directly, without a tolist() round trip.
    outputs = response.outputs
    value: Any = next(iter(outputs.values())) if len(outputs) == 1 else outputs
    return orjson.dumps(value, default=json_default, option=_NUMPY), "application/json"


def health(ready: bool) -> dict[str, str]:
    """TorchServe's health answer (`/ping` body, gRPC `Ping`'s `health` JSON)."""
    return {"status": "Healthy" if ready else "Unhealthy"}
