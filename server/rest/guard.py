"""RequestGuard: the ASGI layer in front of each HTTP app that checks the key and bounds the body.

It runs before routing, so it covers every route, the inference DirectRoutes included: a key
check is one header lookup and a constant-time compare. The body limit counts the bytes
`receive()` hands the app, so a lying or absent Content-Length (chunked) is caught as the bytes
arrive, and nothing is buffered beyond what the app itself reads.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scriptserve.server.errors import PayloadTooLarge, ServingError
from scriptserve.server.rest.errors import error_body
from scriptserve.server.security import AccessKeys, Api


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


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than the server's limit of {limit} bytes")


class RequestGuard:
    """Wrap an ASGI app: `api`'s key on every path but `open_paths`; bodies up to `max_bytes`."""

    def __init__(
        self,
        app: ASGIApp,
        keys: AccessKeys,
        api: Api,
        max_bytes: int,
        open_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.keys = keys
        self.api = api
        self.max_bytes = max_bytes
        self.open_paths = open_paths
        self.auth = keys.required(api)

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
        if self.auth and scope["path"] not in self.open_paths:
            header = authorization.decode("latin-1") if authorization is not None else None
            error = self.keys.check(self.api, header)
            if error is not None:
                await send_error(scope, send, error)
                return
        limit = self.max_bytes
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                await send_error(scope, send, _too_large(limit))
                return
            # The HTTP server frames the body by Content-Length: the app can never receive more
            # than was declared (a longer body is read as the next request, and refused as such),
            # so the common case needs no counting.
            await self.app(scope, receive, send)
            return
        too_large = _too_large(limit)
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


def guarded(app: Any, keys: AccessKeys, api: Api, max_bytes: int, *open_paths: str) -> Any:
    return RequestGuard(app, keys, api, max_bytes, frozenset(open_paths))
