"""KeyInterceptor: the gRPC side of the access keys (metadata `authorization: Bearer <key>`).

Health checks pass without a key (probes carry none, and they reveal only SERVING or not);
every other method, reflection included, needs the API's key, and the methods that change what
the server runs (Triton's repository load and unload, and its index) the management key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from scriptserve.server.errors import ServingError
from scriptserve.server.grpc.status import status_code
from scriptserve.server.security import AccessKeys, Api

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def _refusal(handler: grpc.RpcMethodHandler, error: ServingError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `error`."""
    code, message = status_code(error), error.message

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    key = (bool(handler.request_streaming), bool(handler.response_streaming))
    make = kinds[key]
    return make(
        streaming if key[1] else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class KeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuse calls without `api`'s key (the management key for `management_methods`, full
    method names): UNAUTHENTICATED, or PERMISSION_DENIED for the other API's key."""

    def __init__(
        self, keys: AccessKeys, api: Api, management_methods: frozenset[str] = frozenset()
    ) -> None:
        self.keys = keys
        self.api = api
        self.management_methods = management_methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        api: Api = "management" if method in self.management_methods else self.api
        if method.startswith(OPEN_PREFIXES) or not self.keys.required(api):
            return await continuation(handler_call_details)
        error = self.keys.check(api, authorization_of(handler_call_details.invocation_metadata))
        handler = await continuation(handler_call_details)
        if error is None or handler is None:
            return handler
        return _refusal(handler, error)


def authorization_of(metadata: Any) -> str | None:
    """The `authorization` value of a call's metadata, if it has one."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def interceptors(
    keys: AccessKeys, api: Api, management_methods: frozenset[str] = frozenset()
) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a server for `api` needs: none when the API checks no key. Without
    one, `management_methods` check the management key themselves (`authorization_of`): an
    interceptor costs every call of the port."""
    return [KeyInterceptor(keys, api, management_methods)] if keys.required(api) else []
