"""Error responses: the one place that turns a ServingError into an HTTP answer.

TorchServe routes answer `{"code", "type", "message"}`; Open Inference Protocol routes answer
`{"error": message}` as the spec says, and KServe v1 routes (`/v1/...`) the same, as KServe's
model server does; OpenAI's `/v1/embeddings` answers `{"error": {"message", "type", ...}}`, as
OpenAI's API does. The request guard (before routing) and the apps' error
handlers both answer with `error_body`: for every error, unknown routes and methods (404, 405)
and unexpected failures (500) included.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from scriptserve.server.codec.openai_embeddings import PATH as OPENAI_EMBEDDINGS
from scriptserve.server.errors import (
    InvalidInput,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
    ServingError,
    error_for_status,
    invalid_fields,
)


def error_body(path: str, error: ServingError) -> bytes:
    if path == OPENAI_EMBEDDINGS:
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        detail = {"message": error.message, "type": kind, "param": None, "code": error.status}
        return json.dumps({"error": detail}).encode()
    if path.startswith(("/v2", "/v1/")):
        return json.dumps({"error": error.message}).encode()
    body = {"code": error.status, "type": type(error).__name__, "message": error.message}
    return json.dumps(body).encode()


def error_response(request: Request, error: ServingError) -> Response:
    return Response(
        error_body(request.url.path, error),
        error.status,
        headers=error.headers,
        media_type="application/json",
    )


def body_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than the server's limit of {limit} bytes")


def method_not_allowed(method: str, allowed: str) -> MethodNotAllowed:
    """`method` on a route that takes only `allowed` (`POST, PUT`)."""
    return MethodNotAllowed(
        f"method {method} is not allowed on this route; use {allowed}", {"Allow": allowed}
    )


def routing_error(request: Request, exc: HTTPException) -> ServingError:
    """What the router (or a body parser) refused, as one of the server's errors."""
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return RouteNotFound("not found: no route matches this path", headers)
    if exc.status_code == 405:
        allowed = headers.get("Allow") or headers.get("allow") or "another method"
        return method_not_allowed(request.method, allowed)
    error = error_for_status(exc.status_code, str(exc.detail))
    error.headers = headers
    return error


def install_error_handlers(app: FastAPI) -> None:
    async def on_serving_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServingError)
        return error_response(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(request, InvalidInput(invalid_fields(exc.errors())))

    async def on_routing_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(request, routing_error(request, exc))

    async def on_unexpected_error(request: Request, exc: Exception) -> Response:
        # Starlette raises the exception again once this answer is sent: the server logs it.
        return error_response(request, ServingError("internal server error; see the server log"))

    app.add_exception_handler(ServingError, on_serving_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_routing_error)
    app.add_exception_handler(Exception, on_unexpected_error)
