"""One error hierarchy for the server. Each error carries its HTTP status; one table in
`server/grpc/status.py` gives each its gRPC code.

Messages say what was wrong in terms of the request and what to do; they never carry internal
paths, queue names or stack traces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class ServingError(Exception):
    """Base of every error a client may see."""

    status: int = 500

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


class Unauthenticated(ServingError):
    status = 401


class PermissionDenied(ServingError):
    status = 403


class ModelNotFound(ServingError):
    status = 404


class RouteNotFound(ServingError):
    """No HTTP route, or no gRPC method, has this name."""

    status = 404


class MethodNotAllowed(ServingError):
    status = 405


class Conflict(ServingError):
    status = 409


class PayloadTooLarge(ServingError):
    status = 413


class InferenceFailed(ServingError):
    """The handler raised or returned an error for this request."""

    status = 500


class ModelNotReady(ServingError):
    status = 503


class QueueFull(ServingError):
    status = 503

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class DeadlineExceeded(ServingError):
    status = 504


class StreamOverrun(ServingError):
    """A client read its stream so slowly that the parts waiting for it reached the bound."""

    status = 429


def error_for_status(status: int, message: str) -> ServingError:
    """The error for a status a handler chose (e.g. 400 for one bad item in a batch)."""
    for cls in (InvalidInput, ModelNotFound, PayloadTooLarge, QueueFull, DeadlineExceeded):
        if cls.status == status:
            return cls(message)
    if 400 <= status < 500:
        return InvalidInput(message, status=status)
    return InferenceFailed(message, status=status if status >= 500 else None)


def invalid_fields(errors: Iterable[Mapping[str, Any]]) -> str:
    """One line naming each invalid parameter, from pydantic's (or FastAPI's) error list."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "path", "body"))
        message = str(err.get("msg", "invalid"))
        parts.append(f"{where}: {message}" if where else message)
    return "invalid request parameter(s): " + "; ".join(parts)
