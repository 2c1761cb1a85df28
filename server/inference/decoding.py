"""What a queued request becomes on the worker that takes it: decoded (when it was queued as its
client sent it), checked against its model's signature, named, and its answer made (`Served`).

Every request is decoded and checked here, off the event loop, by the worker thread that takes
its job (`Admitted`): the event loop is the one thread every request passes through, and
decoding a JSON tensor there was a third of its GIL-held samples on OIP's JSON route. What cannot
be decoded, or does not fit the model's signature, is the client's error (400), answered alone:
the rest of its batch runs. What the decoding needs from the loop's context (the access log's
record, which names the request) is given when the job is queued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.handlers.runtime.signature import Signature, SignatureError
from scriptserve.server.errors import InvalidInput, ServingError
from scriptserve.server.models.registry import ModelVersion
from scriptserve.server.observability.access_log import AccessRecord

log = logging.getLogger("scriptserve.dataplane")


@dataclass(frozen=True)
class Served:
    """A request's answer and the model version that gave it."""

    model_name: str
    model_version: str
    response: InferenceResponse
    outputs: list[tuple[str, np.ndarray]] = field(default_factory=list)
    """The output tensors a tensor protocol answers with, selected and ordered; empty when the
    request asked for the handler's answer as it is (TorchServe's predictions)."""


Request = InferenceRequest | Callable[[], InferenceRequest]
"""A request, or the function that decodes it from the wire (it raises InvalidInput)."""
Encode = Callable[[str, str, list[tuple[str, np.ndarray]]], object]
"""What writes a tensor answer in the transport's wire format, called with the answering model's
name and version and the selected outputs; the transport keeps what it makes (see `Admitted`)."""
T = TypeVar("T")


class Admitted:
    """A queued request as its worker takes it (the job's `decode`): called on the worker's
    thread, it returns the request decoded, named and checked, or raises the ServingError that
    answers it (InvalidInput, 400); `served` makes its answer, and its wire format too when the
    transport gave an `encode` (OIP over REST and gRPC's ModelInfer: the answer is written on
    the worker's thread, as its request was read there, not on the event loop)."""

    __slots__ = ("_encode", "_given", "_mv", "_record", "outputs")

    def __init__(
        self,
        mv: ModelVersion,
        request: Request,
        record: AccessRecord | None,
        encode: Encode | None = None,
    ) -> None:
        """`record`: the request's access line, while the access log is on (it names the
        request: the client's header id, when it sent one, is the request's id)."""
        self._mv = mv
        self._given = request
        self._record = record
        self._encode = encode
        self.outputs: list[str] | None = None
        """The outputs the decoded request asks for (what `served` selects)."""

    def __call__(self) -> InferenceRequest:
        mv, given = self._mv, self._given
        request = given if isinstance(given, InferenceRequest) else decode_checked(mv, given)
        if self._record is not None:
            request.request_id = self._record.name(request.request_id)
        if mv.request_signature is not None and request.outputs is not None:
            check_signature(mv.name, mv.request_signature, request.inputs)
        self.outputs = request.outputs
        return request

    @property
    def source(self) -> object:
        """What decodes the request: the wire object whose method the decoding is (an OIP body,
        which can read a batch's bodies together, `batching.decode_jobs`), else the function."""
        return getattr(self._given, "__self__", self._given)

    def served(self, response: InferenceResponse) -> Served:
        """The decoded request's answer, on the worker's thread: with the outputs a tensor
        protocol asked for, selected and ordered (and encoded, when the transport said how)."""
        mv, outputs = self._mv, self.outputs
        if outputs is None:
            return Served(mv.name, mv.version, response)
        selected = select_outputs(mv.name, response.outputs, outputs)
        if self._encode is not None:
            self._encode(mv.name, mv.version, selected)
        return Served(mv.name, mv.version, response, selected)


def decode_checked(mv: ModelVersion, decode: Callable[[], T]) -> T:
    """Decode what the client sent, once the model is known to serve: whatever cannot be decoded
    is the client's error (400), never the server's."""
    try:
        return decode()
    except ServingError:
        raise
    except Exception as exc:
        log.debug("model=%s a request could not be decoded: %r", mv.name, exc)
        raise InvalidInput(
            f"the request could not be decoded ({type(exc).__name__}); check it against "
            f"the model's metadata (GET /v2/models/{mv.name})"
        ) from None


def select_outputs(
    model_name: str, outputs: Mapping[str, np.ndarray], requested: Sequence[str]
) -> list[tuple[str, np.ndarray]]:
    """The outputs a tensor protocol answers with: the requested ones in their order, or all.

    A model that answers with a body (a TorchServe-style handler) has no tensors to give.
    """
    if not outputs:
        raise InvalidInput(
            f"model {model_name!r} answers with a body, not tensors; call /predictions "
            "(or the TorchServe gRPC Predictions method)"
        )
    unknown = [n for n in requested if n not in outputs]
    if unknown:
        known = ", ".join(outputs)
        raise InvalidInput(f"unknown output(s) {', '.join(unknown)}; the model's are {known}")
    return [(name, outputs[name]) for name in requested or outputs]


def check_signature(
    model_name: str, signature: Signature, inputs: Mapping[str, np.ndarray]
) -> None:
    """A tensor request against the inputs its model takes (`Signature.check_inputs`, the check
    the tensor handler makes too); InvalidInput naming the first difference."""
    try:
        signature.check_inputs(inputs)
    except SignatureError as exc:
        raise InvalidInput(f"model {model_name!r}: {exc}") from None
