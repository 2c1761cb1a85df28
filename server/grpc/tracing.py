"""Tracing's gRPC side: an interceptor, first in line (so refused calls are traced too), that
opens each call's server span, the child of the client's `traceparent` metadata, returns the
span's own `traceparent` as initial metadata, and ends it when the call ends
(server/observability/tracing.py makes its children). A call without trace context that the
sampling ratio leaves out gets no span and no `traceparent`. Installed only when tracing is on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from scriptserve.server.grpc.wrapping import Behavior, wrapped
from scriptserve.server.observability.tracing import (
    TRACEPARENT,
    RequestTrace,
    Tracing,
    error_for_grpc,
    headers_of,
    opened,
)


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The code the call ended with."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class TracingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """One SERVER span per call (see the module docstring)."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        headers = headers_of(details.invocation_metadata)
        method: str = details.method
        return wrapped(
            handler,
            unary=lambda behavior: self._unary(behavior, method, headers),
            streaming=lambda behavior: self._streaming(behavior, method, headers),
        )

    async def _start(
        self, method: str, headers: dict[str, str], context: grpc.aio.ServicerContext
    ) -> RequestTrace | None:
        """The call's server span, its `traceparent` sent; None for a root the ratio leaves
        out."""
        if not headers and self.tracing.leaves_out_root():
            return None
        name = method.lstrip("/")
        service, _, rpc = name.rpartition("/")
        attributes: dict[str, str | int] = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": rpc,
        }
        peer = (context.peer() or "").removeprefix("ipv4:").removeprefix("ipv6:")
        address, _, port = peer.rpartition(":")
        if address and port.isdigit():
            attributes["client.address"], attributes["client.port"] = address, int(port)
        trace = self.tracing.start(name, headers, attributes)
        await context.send_initial_metadata(((TRACEPARENT, self.tracing.traceparent(trace)),))
        return trace

    def _end(self, trace: RequestTrace | None, context: Any, error: BaseException | None) -> None:
        if trace is None or not trace.recording:
            return
        code = _code(context, error)
        self.tracing.end(trace, {"rpc.grpc.status_code": code.value[0]}, error_for_grpc(code.name))

    def _unary(self, behavior: Behavior, method: str, headers: dict[str, str]) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            trace = await self._start(method, headers, context)
            error: BaseException | None = None
            with opened(trace):
                try:
                    return await behavior(request, context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    self._end(trace, context, error)

        return call

    def _streaming(self, behavior: Behavior, method: str, headers: dict[str, str]) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            trace = await self._start(method, headers, context)
            error: BaseException | None = None
            with opened(trace):
                try:
                    replies = behavior(request, context)
                    if not hasattr(replies, "__aiter__"):  # it writes with context.write
                        await replies
                        return
                    async for reply in replies:
                        yield reply
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    self._end(trace, context, error)

        return call
