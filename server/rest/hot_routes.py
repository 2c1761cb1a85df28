"""The inference routes served below FastAPI: a plain ASGI layer that matches them by hand.

`/predictions/{model_name}[/{version}]` (POST, PUT) and `/v2/models/{model_name}[/versions/
{version}]/infer` (POST) carry nearly every request a server answers. Through FastAPI each one
passed five middlewares (server errors, telemetry, a body limit of its own, exception handlers,
an exit stack) and a linear scan of every route before the endpoint ran: about a sixth of the
event loop's time per request in benchmark scenario A. `HotRoutes` sits between the request
guard (keys, body limits: unchanged, before it) and the FastAPI app: a request for one of these
routes goes straight to the same endpoint function FastAPI would call; everything else, a
method these routes do not take included, goes on to FastAPI as before. The routes stay
registered in the FastAPI app, so the OpenAPI document describes them.

Errors are answered as the app's handlers answer them (`errors.error_body`), an unexpected one
as a logged 500, and `scope["route"]` names the route template, as Starlette's router sets it,
for the access log, tracing and the guard.

By default the inference server's HTTP protocol answers these routes before any ASGI layer
(`protocol_routes.py`, with `hot_route` below); they reach this layer while the access log or
tracing is on, and for bodies the protocol leaves to Starlette (multipart forms).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from scriptserve.server.errors import ServingError
from scriptserve.server.rest.errors import routing_error
from scriptserve.server.rest.guard import send_error

log = logging.getLogger("scriptserve.rest")

Endpoint = Callable[[Request, str, str | None], Awaitable[Response]]
"""An endpoint of a hot route: (request, model name, version or None) -> the response."""

PREDICTIONS = "/predictions/"
MODELS = "/v2/models/"
INFER_SUFFIX = "/infer"
_PREDICT_METHODS = frozenset(("POST", "PUT"))


PREDICT, PREDICT_VERSION, INFER, INFER_VERSION = range(4)
"""The hot routes, in the order of `ROUTES`."""
ROUTES = (
    "/predictions/{model_name}",
    "/predictions/{model_name}/{version}",
    "/v2/models/{model_name}/infer",
    "/v2/models/{model_name}/versions/{version}/infer",
)
PREDICT_ROUTES = (PREDICT, PREDICT_VERSION)


def hot_route(method: str, path: str) -> tuple[int, str, str | None] | None:
    """Which hot route (`PREDICT`...), model name and version a request is for, else None."""
    if path.startswith(PREDICTIONS):
        if method not in _PREDICT_METHODS:
            return None
        parts = path[len(PREDICTIONS) :].split("/")
        if len(parts) == 1 and parts[0]:
            return PREDICT, parts[0], None
        if len(parts) == 2 and parts[0] and parts[1]:
            return PREDICT_VERSION, parts[0], parts[1]
        return None
    if method == "POST" and path.startswith(MODELS) and path.endswith(INFER_SUFFIX):
        parts = path[len(MODELS) : -len(INFER_SUFFIX)].split("/")
        if len(parts) == 1 and parts[0]:
            return INFER, parts[0], None
        if len(parts) == 3 and parts[0] and parts[1] == "versions" and parts[2]:
            return INFER_VERSION, parts[0], parts[2]
    return None


class HotRoutes:
    """Serve TorchServe's predictions and OIP's infer routes with `predict` and `infer`,
    everything else with `app` (see the module)."""

    def __init__(
        self, app: ASGIApp, routes: list[BaseRoute], predict: Endpoint, infer: Endpoint
    ) -> None:
        self.app = app
        self.predict = predict
        self.infer = infer
        by_path = {getattr(r, "path", None): r for r in routes}
        self._routes = tuple(by_path[path] for path in ROUTES)

    def match(self, method: str, path: str) -> tuple[Endpoint, BaseRoute, str, str | None] | None:
        """The endpoint, route, model name and version of a hot route, else None."""
        hot = hot_route(method, path)
        if hot is None:
            return None
        route, name, version = hot
        endpoint = self.predict if route in PREDICT_ROUTES else self.infer
        return endpoint, self._routes[route], name, version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.match(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if hot is None:
            await self.app(scope, receive, send)
            return
        endpoint, route, name, version = hot
        scope["route"] = route
        scope["path_params"] = (
            {"model_name": name} if version is None else {"model_name": name, "version": version}
        )
        request = Request(scope, receive)
        try:
            response = await endpoint(request, name, version)
        except ServingError as exc:
            await send_error(scope, send, exc)
            return
        except HTTPException as exc:  # what Starlette's body parsers refuse
            await send_error(scope, send, routing_error(request, exc))
            return
        except ClientDisconnect:
            raise  # the guard counts it
        except Exception:
            log.exception("model=%s version=%s: unexpected failure", name, version or "default")
            await send_error(scope, send, ServingError("internal server error; see the server log"))
            return
        await response(scope, receive, send)
