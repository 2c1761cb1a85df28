"""The one table from the error hierarchy to gRPC status codes, and how a call ends with one.

Every class in `server/errors.py` has its row (a test checks it); a subclass not listed takes
its nearest listed base's code.
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc

from scriptserve.server.errors import (
    Conflict,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    MethodNotAllowed,
    ModelNotFound,
    ModelNotReady,
    PayloadTooLarge,
    PermissionDenied,
    QueueFull,
    RouteNotFound,
    ServingError,
    StreamOverrun,
    Unauthenticated,
)
from scriptserve.server.inference.dataplane import DEADLINE_SLACK_S
from scriptserve.server.observability.access_log import HEADER, current_request_id

GRPC_CODES: dict[type[ServingError], grpc.StatusCode] = {
    ServingError: grpc.StatusCode.INTERNAL,
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    RouteNotFound: grpc.StatusCode.UNIMPLEMENTED,
    MethodNotAllowed: grpc.StatusCode.UNIMPLEMENTED,
    Conflict: grpc.StatusCode.ALREADY_EXISTS,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InferenceFailed: grpc.StatusCode.INTERNAL,
    ModelNotReady: grpc.StatusCode.UNAVAILABLE,
    QueueFull: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    StreamOverrun: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_code(error: ServingError) -> grpc.StatusCode:
    """The gRPC code of an error: its class's row, else its nearest listed base's."""
    for cls in type(error).__mro__:
        code = GRPC_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL  # not reached: ServingError has a row


async def abort(context: grpc.aio.ServicerContext, error: ServingError) -> NoReturn:
    """End the call with the error's gRPC code and message.

    When the call's own deadline is (about to be) reached, gRPC core answers DEADLINE_EXCEEDED
    itself; a status sent now would race it and fail in core with a logged traceback, so the
    handler just stops.
    """
    remaining = context.time_remaining()
    if (
        isinstance(error, DeadlineExceeded)
        and remaining is not None
        and remaining <= DEADLINE_SLACK_S
    ):
        raise asyncio.CancelledError
    request_id = current_request_id()
    trailers = ((HEADER, request_id),) if request_id is not None else ()
    await context.abort(status_code(error), error.message, trailers)
    raise AssertionError("context.abort returned")  # it raises
