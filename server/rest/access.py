"""The access log's HTTP side: an ASGI layer outside everything else (so refused requests are
logged too) that opens the request's AccessRecord, returns its id as `X-Request-Id`, and writes
the line once the answer is sent. Installed only when the access log is on."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scriptserve.handlers.base import new_request_id
from scriptserve.server.access_log import AccessLog, AccessRecord, opened, usable_request_id

_HEADER = b"x-request-id"


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class AccessLogged:
    """Wrap an HTTP app so that each request writes one access line (the path without its
    query string, which may carry credentials)."""

    def __init__(self, app: ASGIApp, access: AccessLog) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == _HEADER), None)
        request_id = usable_request_id(given.decode("latin-1")) if given is not None else None
        record = AccessRecord(scope["method"], scope["path"], _client(scope), "rest", request_id)
        status = 500  # what the HTTP server answers when the app raises before answering

        async def logged_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if record.request_id is None:
                    record.request_id = new_request_id()
                headers = [*message.get("headers", ()), (_HEADER, record.request_id.encode())]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                record.bytes_sent += len(message.get("body", b""))
            await send(message)

        with opened(record):
            try:
                await self.app(scope, receive, logged_send)
            finally:
                record.finish(status)
                self.access.write(record)
