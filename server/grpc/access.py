"""The access log's gRPC side: an interceptor, first in line (so refused calls are logged too),
that opens each call's AccessRecord, returns its id as trailing metadata `x-request-id`, and
writes the line when the call ends: the RPC, the status code's name, the bytes of the replies.
Installed only when the access log is on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from scriptserve.server.grpc.wrapping import Behavior, wrapped
from scriptserve.server.observability.access_log import (
    HEADER,
    AccessLog,
    AccessRecord,
    opened,
    usable_request_id,
)


def _status(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The name of the code the call ended with."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if error is None:
        return "OK"
    return "CANCELLED" if isinstance(error, asyncio.CancelledError) else "UNKNOWN"


class _CountingWrites:
    """The servicer's context, counting the bytes of the replies it writes itself."""

    def __init__(self, context: grpc.aio.ServicerContext, record: AccessRecord) -> None:
        self._context = context
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        self._record.bytes_sent += _size(message)
        await self._context.write(message)


def _peer(context: grpc.aio.ServicerContext) -> str:
    peer = context.peer() or "-"
    return peer.removeprefix("ipv4:").removeprefix("ipv6:")


def _size(message: Any) -> int:
    size = getattr(message, "ByteSize", None)
    return int(size()) if size is not None else 0


class AccessInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """One access line per call (see the module docstring)."""

    def __init__(self, access: AccessLog) -> None:
        self.access = access

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == HEADER), None)
        request_id = usable_request_id(given if isinstance(given, str) else None)
        method: str = details.method
        return wrapped(
            handler,
            unary=lambda behavior: self._unary(behavior, method, request_id),
            streaming=lambda behavior: self._streaming(behavior, method, request_id),
        )

    def _record(self, method: str, request_id: str | None, context: Any) -> AccessRecord:
        return AccessRecord("gRPC", method, _peer(context), "grpc", request_id)

    def _end(self, record: AccessRecord, context: Any, error: BaseException | None) -> None:
        record.finish(_status(context, error))
        self.access.write(record)

    def _unary(self, behavior: Behavior, method: str, request_id: str | None) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            record = self._record(method, request_id, context)
            error: BaseException | None = None
            with opened(record):
                try:
                    reply = await behavior(request, context)
                    record.bytes_sent += _size(reply)
                    context.set_trailing_metadata(((HEADER, record.request_id or ""),))
                    return reply
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    self._end(record, context, error)

        return call

    def _streaming(self, behavior: Behavior, method: str, request_id: str | None) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            record = self._record(method, request_id, context)
            error: BaseException | None = None
            with opened(record):
                try:
                    replies = behavior(request, _CountingWrites(context, record))
                    if not hasattr(replies, "__aiter__"):  # it writes with context.write
                        await replies
                        return
                    async for reply in replies:
                        record.bytes_sent += _size(reply)
                        yield reply
                    context.set_trailing_metadata(((HEADER, record.request_id or ""),))
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    self._end(record, context, error)

        return call
