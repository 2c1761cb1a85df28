"""TorchServeHandler: a TorchServe entry point behind our handler API.

Requests become TorchServe's `data` list, one dict per request: a raw body is `{"body": ...}`
(parsed JSON for `application/json`, text for `text/*`, else bytes), multipart and gRPC input
fields are `{name: bytes}`, and Open Inference Protocol tensors are `{"body": nested lists}`
exactly as if the same JSON had been posted to `/predictions` (several inputs: `{name: lists}`).
The handler's list of results comes back one per request: strings as text, bytes as they are,
anything else as JSON, with the status, content type and headers the handler set on the context.
For tensor requests a numeric result is also the output tensor `predict` (TorchServe's KServe v2
envelope's name), or one output per key of a dict of numbers.

As in TorchServe, a `PredictionException` fails every request of the batch with its code, and a
result list whose length differs from the batch fails every request of the batch. A handler that
calls `send_intermediate_predict_response` streams: each call sends one part per request, and
what `handle` returns is each request's last part.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from scriptserve import __version__
from scriptserve.handlers.backends import parse_device
from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
)
from scriptserve.handlers.legacy_names import legacy_names
from scriptserve.handlers.parts import send_parts
from scriptserve.handlers.torchserve.ts.context import Context as TsContext
from scriptserve.handlers.torchserve.ts.context import RequestProcessor
from scriptserve.handlers.torchserve.ts.metrics import MetricsCache
from scriptserve.handlers.torchserve.ts.utils.util import PredictionException

log = logging.getLogger("scriptserve.torchserve")

TS_OUTPUT_NAME = "predict"


@dataclass(frozen=True)
class EntryPoint:
    """How to build one TorchServe handler: a class to instantiate, or a module function."""

    description: str
    handler_class: type | None = None
    function: Callable[[Any, Any], Any] | None = None

    def build(self) -> tuple[Callable[[Any, Any], Any], Callable[[Any], Any]]:
        """(handle, initialize) for one worker, as TorchServe's model loader builds them."""
        if self.handler_class is not None:
            service = self.handler_class()
            handle = getattr(service, "handle", None)
            if not callable(handle):
                raise HandlerError(f"{self.description} has no handle(data, context) method")
            initialize = getattr(service, "initialize", None)
            return handle, initialize if callable(initialize) else (lambda _ctx: None)
        assert self.function is not None
        function = self.function
        # TorchServe calls a function entry point once with data=None to initialize it.
        return function, lambda ctx: function(None, ctx)


def _decode_body(body: bytes, content_type: str | None) -> Any:
    """What TorchServe's backend hands a handler for a raw body of this content type."""
    mime = (content_type or "").split(";")[0].strip().lower()
    if mime == "application/json":
        try:
            return json.loads(body)
        except ValueError:
            return bytearray(body)
    if mime.startswith("text"):
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            return bytearray(body)
    return bytearray(body)


# numpy dtypes -> the Open Inference Protocol's datatypes (TorchServe's kservev2 envelope's names)
_DATATYPES = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
    "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}  # fmt: skip


def request_row(request: InferenceRequest, envelope: str = "body") -> Any:
    """One entry of TorchServe's `data` list. With TorchServe's KServe envelopes a KServe v1
    instance is the entry as it is (`kserve`), and a v2 request's first input is
    `{"name", "shape", "datatype", "data"}` (`kservev2`)."""
    if envelope == "kserve" and request.kserve_instance and request.body is not None:
        return json.loads(request.body)
    if envelope == "kservev2" and request.inputs:
        name, array = next(iter(request.inputs.items()))
        return {
            "name": name,
            "shape": list(array.shape),
            "datatype": _DATATYPES.get(str(array.dtype), "BYTES"),
            "data": array.reshape(-1).tolist(),
        }
    if request.inputs:
        tensors = {name: array.tolist() for name, array in request.inputs.items()}
        return {"body": next(iter(tensors.values())) if len(tensors) == 1 else tensors}
    if request.fields:
        return {name: bytearray(value) for name, value in request.fields.items()}
    return {"body": _decode_body(request.body or b"", request.content_type)}


def _tensor_outputs(value: Any) -> dict[str, np.ndarray]:
    """Output tensors for an OIP request, or {} when the result is not numeric."""
    candidates = value if isinstance(value, dict) else {TS_OUTPUT_NAME: value}
    outputs = {}
    for name, item in candidates.items():
        if isinstance(item, (str, bytes, bytearray)) or item is None:
            return {}
        try:
            array = np.asarray(item)
        except (ValueError, TypeError):
            return {}
        if array.dtype.kind not in "biuf":
            return {}
        outputs[str(name)] = array
    return outputs


def _response(value: Any, processor: RequestProcessor, tensors: bool) -> InferenceResponse:
    status = processor.get_response_status_code()
    headers = dict(processor.get_response_headers())
    content_type = headers.pop("content-type", None) or headers.pop("Content-Type", None)
    if status >= 400:
        phrase = processor.get_response_status_phrase()
        message = phrase or (value if isinstance(value, str) else json.dumps(value, default=str))
        return InferenceResponse(error=message, status=status)
    if isinstance(value, str):
        body: Any = value.encode("utf-8")
        content_type = content_type or "text/plain; charset=utf-8"
    else:
        body = value
    outputs = _tensor_outputs(value) if tensors else {}
    return InferenceResponse(
        outputs=outputs, body=body, content_type=content_type, status=status, headers=headers
    )


def send_intermediate(
    ret: list[Any], req_id_map: Mapping[int, str], code: int, context: Any
) -> None:
    """TorchServe's `send_intermediate_predict_response`: `ret[i]` is request i's next part,
    encoded as `handle`'s results are; raises StreamClosed once no client of the batch listens."""
    if not isinstance(context, TsContext) or not isinstance(ret, list):
        raise HandlerError(
            "send_intermediate_predict_response(ret, context.request_ids, message, code, "
            "context) takes the batch's list of results and the handler's context"
        )
    if len(ret) != len(req_id_map):
        raise HandlerError(
            f"send_intermediate_predict_response was given {len(ret)} results for a batch of "
            f"{len(req_id_map)} requests; give one per request"
        )
    tensors = context.tensor_requests or [False] * len(ret)
    parts = [
        _response(value, processor, wants)
        if code < 400
        else InferenceResponse(error=str(value), status=code, final=True)
        for value, processor, wants in zip(ret, context.request_processor, tensors, strict=True)
    ]
    send_parts(parts)


class TorchServeHandler(BaseHandler):
    """Runs a TorchServe handler; subclasses set `entry` (handlers.loader builds them)."""

    entry: ClassVar[EntryPoint]

    def __init__(self) -> None:
        super().__init__()
        self._handle: Callable[[Any, Any], Any] | None = None
        self.ts_context: TsContext | None = None

    def initialize(self, context: Context) -> None:
        self.context = context
        kind, index = parse_device(context.device)
        properties_gpu = index if kind == "cuda" else None
        self.ts_context = TsContext(
            model_name=context.model_name,
            model_dir=str(Path(context.model_dir)),
            manifest=context.manifest.to_dict(),
            batch_size=context.batch_size,
            gpu=properties_gpu,
            mms_version=__version__,
            metrics=MetricsCache(context.model_name, context.metrics, context.metric_declarations),
            model_yaml_config=dict(context.model_config),
        )
        self.ts_context.system_properties["intra_op_threads"] = context.intra_op_threads
        with legacy_names():
            handle, initialize = self.entry.build()
            try:
                initialize(self.ts_context)
            except PredictionException as exc:
                raise HandlerError(f"the handler failed to initialize: {exc.message}") from None
            except HandlerError:
                raise
            except Exception as exc:
                raise HandlerError(
                    f"{self.entry.description} failed to initialize: {type(exc).__name__}: {exc}"
                ) from None
        self._handle = handle

    def handle(self, requests: list[InferenceRequest], context: Context) -> list[InferenceResponse]:
        assert self._handle is not None and self.ts_context is not None
        ts_context = self.ts_context
        ts_context.request_ids = {i: r.request_id for i, r in enumerate(requests)}
        ts_context.metrics.request_ids = ts_context.request_ids
        ts_context.request_processor = [RequestProcessor(r.headers) for r in requests]
        ts_context.tensor_requests = [bool(r.inputs) for r in requests]
        data = [request_row(r, context.service_envelope) for r in requests]
        ids = ",".join(r.request_id for r in requests)
        # The worker running this handler holds `legacy_names()` open for its whole life.
        try:
            results = self._handle(data, ts_context)
        except PredictionException as exc:
            log.warning("model=%s request_ids=%s %s", context.model_name, ids, exc.message)
            raise HandlerError(exc.message, exc.error_code) from None
        except HandlerError:
            raise
        except Exception as exc:
            # The exception's text can hold paths and values: it goes to the log, with the
            # request ids; the client learns that the handler failed, and how.
            log.exception("model=%s request_ids=%s the handler raised", context.model_name, ids)
            raise HandlerError(
                f"Prediction failed: the handler raised {type(exc).__name__}"
            ) from None
        if not isinstance(results, list):
            raise HandlerError(
                f"Invalid model predict output: the handler returned {type(results).__name__}; "
                "it must return a list with one result per request"
            )
        if len(results) != len(requests):
            raise HandlerError(
                f"number of batch response mismatched: the handler returned {len(results)} "
                f"results for a batch of {len(requests)} requests; it must return one per request"
            )
        tensors = [bool(r.inputs) for r in requests]
        return [
            _response(value, processor, wants)
            for value, processor, wants in zip(
                results, ts_context.request_processor, tensors, strict=True
            )
        ]
