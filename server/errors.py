"""One error hierarchy for the server. Each error carries its HTTP status and gRPC code.

Messages say what was wrong in terms of the request and what to do; they never carry internal
paths, queue names or stack traces.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base of every error a client may see."""

    status: int = 500
    grpc_code: str = "INTERNAL"

    def __init__(
        self, message: str, headers: dict[str, str] | None = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        if status is not None:
            self.status = status


class InvalidInput(ServingError):
    status = 400
    grpc_code = "INVALID_ARGUMENT"


class Unauthenticated(ServingError):
    status = 401
    grpc_code = "UNAUTHENTICATED"


class PermissionDenied(ServingError):
    status = 403
    grpc_code = "PERMISSION_DENIED"


class ModelNotFound(ServingError):
    status = 404
    grpc_code = "NOT_FOUND"


class MethodNotAllowed(ServingError):
    status = 405
    grpc_code = "UNIMPLEMENTED"


class Conflict(ServingError):
    status = 409
    grpc_code = "ALREADY_EXISTS"


class PayloadTooLarge(ServingError):
    status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


class InferenceFailed(ServingError):
    """The handler raised or returned an error for this request."""

    status = 500
    grpc_code = "INTERNAL"


class ModelNotReady(ServingError):
    status = 503
    grpc_code = "UNAVAILABLE"


class QueueFull(ServingError):
    status = 503
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class DeadlineExceeded(ServingError):
    status = 504
    grpc_code = "DEADLINE_EXCEEDED"


def error_for_status(status: int, message: str) -> ServingError:
    """The error for a status a handler chose (e.g. 400 for one bad item in a batch)."""
    for cls in (InvalidInput, ModelNotFound, PayloadTooLarge, QueueFull, DeadlineExceeded):
        if cls.status == status:
            return cls(message)
    if 400 <= status < 500:
        return InvalidInput(message, status=status)
    return InferenceFailed(message, status=status if status >= 500 else None)
