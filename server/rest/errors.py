"""Error responses: the one place that turns a ServingError into an HTTP answer.

TorchServe routes answer `{"code", "type", "message"}`; Open Inference Protocol routes answer
`{"error": message}` as the spec says. The request guard (before routing) and the apps' error
handlers both answer with `error_body`.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from scriptserve.server.errors import InvalidInput, ServingError, invalid_fields


def error_body(path: str, error: ServingError) -> bytes:
    if path.startswith("/v2"):
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


def install_error_handlers(app: FastAPI) -> None:
    async def on_serving_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServingError)
        return error_response(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(request, InvalidInput(invalid_fields(exc.errors())))

    app.add_exception_handler(ServingError, on_serving_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
