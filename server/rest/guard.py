"""RequestGuard: the ASGI layer in front of each HTTP app that checks the key and bounds the body.

It runs before routing, so it covers every route of the ASGI app, the DirectRoutes included: a
key check is one header lookup and a constant-time compare. The inference routes the HTTP
protocol answers itself (`protocol_routes.py`) never reach it; the protocol makes the same
checks (`security.AccessKeys`, `errors.body_too_large`, `Disconnects`), with the same answers.
The body limit counts the bytes `receive()` hands the app, so a lying or absent
Content-Length (chunked) is caught as the bytes arrive, and nothing is buffered beyond what
the app itself reads.

A client that goes away before sending its whole body is not the server's error: Starlette
raises ClientDisconnect where the route reads the body, and the guard turns it into a debug line
naming the route and a count (`scriptserve_client_disconnects_total{api}`), never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scriptserve.server.errors import PayloadTooLarge, ServingError
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.rest.errors import body_too_large, error_body
from scriptserve.server.security import AccessKeys, Api

log = logging.getLogger("scriptserve.rest")


async def send_error(scope: Scope, send: Send, error: ServingError) -> None:
    body = error_body(scope.get("path", ""), error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in error.headers.items()),
    ]
    if isinstance(error, PayloadTooLarge):
        headers.append((b"connection", b"close"))  # the rest of the body is never read
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Disconnects:
    """Clients of `api` gone before sending their whole body: counted
    (`scriptserve_client_disconnects_total{api}`) and a debug line naming the route."""

    def __init__(self, metrics: ServerMetrics | None, api: Api) -> None:
        self._counter = metrics.client_disconnects.labels(api) if metrics else None

    def __call__(self, method: str, route: str) -> None:
        if self._counter is not None:
            self._counter.inc()
        log.debug("client went away before sending the whole request body: %s %s", method, route)


def _route(scope: Scope) -> str:
    """The matched route's template (`/v2/models/{model_name}/infer`), else the path."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else str(scope.get("path", ""))


class RequestGuard:
    """Wrap an ASGI app: `api`'s key on every path but `open_paths`, the management key on paths
    that start with one of `management_paths`; bodies up to `max_bytes`; clients gone mid-body
    counted in `metrics`."""

    def __init__(
        self,
        app: ASGIApp,
        keys: AccessKeys,
        api: Api,
        max_bytes: int,
        open_paths: frozenset[str] = frozenset(),
        metrics: ServerMetrics | None = None,
        management_paths: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.keys = keys
        self.api = api
        self.max_bytes = max_bytes
        self.open_paths = open_paths
        self.auth = keys.required(api)
        self.management_paths = management_paths
        self._disconnects = Disconnects(metrics, api)

    def _disconnected(self, scope: Scope) -> None:
        self._disconnects(scope.get("method", "?"), _route(scope))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: bytes | None = None
        authorization: bytes | None = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                declared = value
            elif key == b"authorization":
                authorization = value
        path = scope["path"]
        api: Api = self.api
        if self.management_paths and path.startswith(self.management_paths):
            api = "management"
        if (self.auth or api != self.api) and path not in self.open_paths:
            header = authorization.decode("latin-1") if authorization is not None else None
            error = self.keys.check(api, header)
            if error is not None:
                await send_error(scope, send, error)
                return
        limit = self.max_bytes
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                await send_error(scope, send, body_too_large(limit))
                return
            # The HTTP server frames the body by Content-Length: the app can never receive more
            # than was declared (a longer body is read as the next request, and refused as such),
            # so the common case needs no counting.
            try:
                await self.app(scope, receive, send)
            except ClientDisconnect:
                self._disconnected(scope)
            return
        too_large = body_too_large(limit)
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except PayloadTooLarge as exc:
            # Raised from receive() where the app did not turn it into a response itself.
            if started:
                raise
            await send_error(scope, send, exc)
        except ClientDisconnect:
            self._disconnected(scope)


def guarded(
    app: Any,
    keys: AccessKeys,
    api: Api,
    max_bytes: int,
    *open_paths: str,
    metrics: ServerMetrics | None = None,
    management_paths: tuple[str, ...] = (),
) -> Any:
    return RequestGuard(app, keys, api, max_bytes, frozenset(open_paths), metrics, management_paths)
