"""Error responses: one place that turns a ServingError into an HTTP answer.

TorchServe routes answer `{"code", "type", "message"}`; Open Inference Protocol routes answer
`{"error": message}` as the spec says.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from scriptserve.server.errors import InvalidInput, ServingError


def error_response(request: Request, error: ServingError) -> Response:
    if request.url.path.startswith("/v2"):
        body = {"error": error.message}
    else:
        body: dict[str, object] = {  # type: ignore[no-redef]
            "code": error.status,
            "type": type(error).__name__,
            "message": error.message,
        }
    return Response(
        json.dumps(body), error.status, headers=error.headers, media_type="application/json"
    )


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "path", "body"))
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", ""))
    return "invalid request parameter(s): " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    async def on_serving_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServingError)
        return error_response(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(request, InvalidInput(_validation_message(exc)))

    app.add_exception_handler(ServingError, on_serving_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
