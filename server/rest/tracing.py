"""Tracing's HTTP side: an ASGI layer outside everything else (so refused requests are traced
too) that opens each request's server span, the child of the client's `traceparent`, returns
the span's own `traceparent` header, and ends it once the answer is sent (server/tracing.py
makes its children). Installed only when tracing is on."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scriptserve.server.tracing import (
    TRACEPARENT,
    TRACESTATE,
    Tracing,
    error_for_http,
    opened,
)

_TRACE_HEADERS = (TRACEPARENT.encode(), TRACESTATE.encode())
_TRACEPARENT = TRACEPARENT.encode()


def _attributes(scope: Scope, method: str) -> dict[str, str | int]:
    """A request span's attributes at its start (OpenTelemetry's HTTP server conventions)."""
    attributes: dict[str, str | int] = {
        "http.request.method": method,
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
        "network.protocol.version": scope.get("http_version", "1.1"),
    }
    client, server = scope.get("client"), scope.get("server")
    if client:
        attributes["client.address"], attributes["client.port"] = client[0], client[1]
    if server:
        attributes["server.address"], attributes["server.port"] = server[0], server[1]
    return attributes


class Traced:
    """Wrap an HTTP app so that each request is one SERVER span (see the module docstring)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in _TRACE_HEADERS
        }
        method: str = scope["method"]
        trace = None if headers else self.tracing.unsampled_root()
        if trace is None:
            trace = self.tracing.start(method, headers, _attributes(scope, method))
        traceparent = self.tracing.traceparent(trace).encode()
        status = 500  # what the HTTP server answers when the app raises before answering

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (_TRACEPARENT, traceparent)],
                }
            await send(message)

        if not trace.recording:  # nothing to end or name: only the traceparent goes back
            with opened(trace):
                await self.app(scope, receive, traced_send)
            return
        with opened(trace):
            try:
                await self.app(scope, receive, traced_send)
            finally:
                route = getattr(scope.get("route"), "path", None)
                if route is not None:
                    trace.span.update_name(f"{method} {route}")
                ended: dict[str, str | int] = {"http.response.status_code": status}
                if route is not None:
                    ended["http.route"] = route
                self.tracing.end(trace, ended, error_for_http(status))
