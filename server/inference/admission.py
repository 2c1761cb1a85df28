"""What happens to a request before and after a worker runs it: decoded once its model is known
to serve, by the worker that takes it (what cannot be decoded is the client's error), checked
against the model's signature, expired at its deadline, and its answer named by the version that
gave it (`Served`).

A request given as the function that decodes it from the wire is decoded off the event loop,
by the worker thread that takes its job (`Deferred`): the event loop is the one thread every
request passes through, and decoding a JSON tensor there was a third of its GIL-held samples on
OIP's JSON route. What the decoding needs from the loop's context (the access log's request id) is
read when the job is queued.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.handlers.runtime.signature import Signature, SignatureError
from scriptserve.server.errors import DeadlineExceeded, InvalidInput, ServingError
from scriptserve.server.models.registry import ModelVersion
from scriptserve.server.observability.access_log import request_id_for, request_namer
from scriptserve.server.workers.batching import DynamicBatcher, Job

log = logging.getLogger("scriptserve.dataplane")

CLIENT_CLOSED = 499
"""Metric status of a request whose client went away first (nginx's "client closed request")."""
DEADLINE_SLACK_S = 0.05
"""How near its deadline a call counts as expired: the client's timer and the server's differ by
the network's latency, so a client's cancel may arrive just before the server's deadline."""


def cancelled_status(started: float, timeout_s: float | None) -> int:
    """The status of a call that was cancelled: its client went away (499), or its own
    deadline ended it first (504); neither is a server error."""
    elapsed = time.perf_counter() - started
    expired = timeout_s is not None and elapsed >= timeout_s - DEADLINE_SLACK_S
    return DeadlineExceeded.status if expired else CLIENT_CLOSED


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
T = TypeVar("T")


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


def decoded(mv: ModelVersion, request: Request) -> InferenceRequest:
    """The request as the model's worker will see it, checked now (on the event loop)."""
    if not isinstance(request, InferenceRequest):
        request = decode_checked(mv, request)
    return _checked(mv, request, request_id_for)


class Deferred:
    """A request as its client sent it: `decoded` by the worker that takes it, from its thread
    (the job's `decode`). A request that cannot be decoded or does not fit the model's signature
    raises the ServingError that answers it (InvalidInput, 400)."""

    __slots__ = ("_decode", "_mv", "_name", "_outputs")

    def __init__(self, mv: ModelVersion, decode: Callable[[], InferenceRequest]) -> None:
        self._mv = mv
        self._decode = decode
        self._name = request_namer()  # the access log's record, read on the event loop
        self._outputs: list[str] | None = None

    def __call__(self) -> InferenceRequest:
        request = _checked(self._mv, decode_checked(self._mv, self._decode), self._name)
        self._outputs = request.outputs
        return request

    @property
    def source(self) -> object:
        """What decodes the request: the wire object whose method `decode` is (an OIP body,
        which can read a batch's bodies together, `batching.decode_jobs`), else the function."""
        return getattr(self._decode, "__self__", self._decode)

    @property
    def outputs(self) -> list[str] | None:
        """The outputs the decoded request asks for (what `served_by` selects)."""
        return self._outputs

    def served(self, response: InferenceResponse) -> Served:
        """The decoded request's answer (`served_by`), on the worker's thread."""
        return served_by(self._mv, response, self._outputs)


def admitted(
    mv: ModelVersion,
    request: Request,
    future: asyncio.Future[Served],
    deadline: float,
    streaming: bool = False,
) -> tuple[Job, InferenceRequest | Deferred]:
    """The job that queues `request`, and where the outputs it asks for are read once it is
    decoded: the request itself, checked now, or its `Deferred` decoding by the worker. The
    job's future gets the request's `Served` answer, made by the worker, unless the answer is
    `streaming` (its PartStream makes each part's)."""
    if isinstance(request, InferenceRequest):
        checked = decoded(mv, request)
        finish: Callable[[InferenceResponse], Served] | None = None
        if not streaming:
            finish = functools.partial(served_by, mv, outputs=checked.outputs)
        return Job(checked, future, deadline, finish=finish), checked
    deferred = Deferred(mv, request)
    finish = None if streaming else deferred.served
    return Job(InferenceRequest(), future, deadline, deferred, finish=finish), deferred


def _checked(
    mv: ModelVersion, request: InferenceRequest, name: Callable[[str], str]
) -> InferenceRequest:
    request.request_id = name(request.request_id)
    if mv.request_signature is not None and request.outputs is not None:
        check_signature(mv.name, mv.request_signature, request.inputs)
    return request


def served_by(
    mv: ModelVersion, response: InferenceResponse, outputs: Sequence[str] | None
) -> Served:
    """The answer as the client gets it: with the outputs a tensor protocol asked for."""
    if outputs is None:
        return Served(mv.name, mv.version, response)
    return Served(mv.name, mv.version, response, select_outputs(mv.name, response.outputs, outputs))


def expire(job: Job, batcher: DynamicBatcher, timeout_s: float) -> None:
    """The deadline timer's end: a job not answered yet is withdrawn and answered 504."""
    if not job.future.done():
        batcher.cancel(job)
        job.future.set_exception(
            DeadlineExceeded(f"no answer within the request's deadline of {timeout_s:g} s")
        )


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
